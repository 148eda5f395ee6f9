"""``torch.distributed.checkpoint`` storage for kwplug's version folders: safetensors shards,
streamed, no pickle.

:class:`ShardWriter` is a ``StorageWriter``: ``torch.distributed.checkpoint.save`` plans the
save with its own ``DefaultSavePlanner`` (deduplicating replicated tensors), and each rank's
``write_data`` writes the local shards its plan gives it into one safetensors file,
``<prefix>-shard_<rank>.safetensors`` in the version folder, straight from the tensors' memory
(``safetensors.torch.save_file`` through :func:`kwplug.checkpoint._codec.write_state`: no
copy of the shard, unlike torch's ``HuggingFaceStorageWriter``, which serialises each file
into a buffer first), then fsyncs and hashes it for the manifest. Where each local shard
sits in its full tensor is stored in the file's header under torch's own key
(``DCP_SHARDING_INFO``: ``{fqn: {"saved_offsets": [...]}}``), the one
``HuggingFaceStorageReader`` reads. ``finish`` writes nothing: DCP's ``Metadata`` is rebuilt
from the shards' headers when loading, so no ``.metadata`` pickle exists.

:class:`ShardReader` is torch's ``HuggingFaceStorageReader`` (its ``read_metadata`` builds
DCP's ``Metadata`` from the headers; ``DefaultLoadPlanner`` reshards), reading each slice
with safetensors' ``pread`` backend: one slice in memory at a time, no page-cache mapping
of the file. It reads only the files it is given, each verified against the manifest first.
"""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.checkpoint._hf_utils import CUSTOM_METADATA_KEY, SAVED_OFFSETS_KEY
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from kwplug.checkpoint import _codec as codec
from kwplug.checkpoint import _layout as layout
from kwplug.checkpoint import _reader as reader


class ShardWriter(StorageWriter):
    """Writes this rank's local shards into ``folder/<prefix>-shard_<rank>.safetensors``.

    Args:
        folder: the version folder being staged.
        prefix: the state's name (``model_<i>``, ``optimizer_<i>``).
        rank: this process's global rank (names its file).
        kind: ``module.Class`` of what is saved, stored in the file's header.

    Attributes:
        records: after ``write_data``, ``{file name: (size, checksum)}`` of what this rank wrote.
    """

    def __init__(self, folder: Path, prefix: str, rank: int, kind: str) -> None:
        super().__init__()
        self.folder, self.prefix, self.rank, self.kind = folder, prefix, rank, kind
        self.records: dict[str, tuple[int, str]] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Nothing to reset: one writer per save."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up (the folder is the staged version's)."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """The plan as DCP's planner made it."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The plans as DCP's planner made them (each rank writes one file)."""
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write the plan's items (local shards, or whole tensors) as one safetensors file.

        Raises:
            TypeError: an item is not a tensor (non-tensor state is stored as JSON beside the
                shards, never through DCP: its bytes items are pickles).
            ValueError: the plan holds two pieces of one tensor (one file holds one per name).
            OSError: the write failed (``ENOSPC``: the disk is full).
        """
        tensors: dict[str, torch.Tensor] = {}
        offsets: dict[str, dict[str, list[int]]] = {}
        results: list[WriteResult] = []
        name = layout.shard_file(self.prefix, self.rank)
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise TypeError(
                    f"cannot store {item.index.fqn!r} as a shard: it is not a tensor (kwplug "
                    "stores non-tensor state as JSON)"
                )
            data = planner.resolve_data(item)
            assert isinstance(data, torch.Tensor)
            fqn = item.index.fqn
            if fqn in tensors:
                raise ValueError(f"this rank holds two pieces of {fqn!r}; one file holds one")
            tensors[fqn] = data.detach()
            chunk = item.tensor_data.chunk.offsets if item.tensor_data is not None else ()
            offsets[fqn] = {SAVED_OFFSETS_KEY: [int(o) for o in chunk]}
            nbytes = data.numel() * data.element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=name))
        if tensors:
            extra = {CUSTOM_METADATA_KEY: json.dumps(offsets), "class": self.kind}
            self.records[name] = codec.write_state(self.folder / name, tensors, extra)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing: DCP's ``Metadata`` is rebuilt from the shards' headers when loading."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Never chosen by a checkpoint id: kwplug passes the writer itself."""
        return False

    def storage_meta(self) -> StorageMeta | None:
        """No storage metadata (nothing is written by ``finish``)."""
        return None


class _Listed:
    # torch's reader finds its files with fs.ls(path): here, the given (verified) ones only.
    def __init__(self, fs: Any, files: list[str]) -> None:
        self._fs, self._files = fs, files

    def ls(self, path: Any) -> list[str]:
        return list(self._files)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


class ShardReader(HuggingFaceStorageReader):
    """torch's ``HuggingFaceStorageReader`` over the given shard files (each verified first),
    reading each slice with safetensors' ``pread`` backend.

    Args:
        files: the ``.safetensors`` shard files of one state (the model's, or a plain
            ``model_<i>.safetensors`` state dict: whole tensors at offset 0).
    """

    def __init__(self, files: list[Path]) -> None:
        super().__init__(path=str(files[0].parent) if files else ".")
        self.fs = _Listed(self.fs, [str(f) for f in files])  # type: ignore[assignment]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read each planned slice into its target tensor: straight into the target's memory
        (``preadv``, no intermediate tensor) where the slice is one contiguous span of the
        file of the target's dtype and the target is contiguous; otherwise through
        safetensors' ``pread`` backend, one slice in memory at a time.

        Raises:
            OSError: a file is shorter than its header says (changed since it was verified).
        """
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for file_name, items in per_file.items():
            fd = reader.open_regular(Path(file_name))
            try:
                spans = _Spans(fd)
                rest = [item for item in items if not spans.read_into(item, planner)]
            finally:
                os.close(fd)
            if rest:
                with safe_open(file_name, framework="pt", backend="pread") as opened:
                    for item in rest:
                        self._process_read_request(opened, item, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future


class _Spans:
    # The tensors of one safetensors file (its header), and direct reads of their bytes.
    def __init__(self, fd: int) -> None:
        self.fd, self.size = fd, os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        length = int.from_bytes(head, "little") if len(head) == 8 else self.size
        self.start = 8 + length
        try:
            raw = os.pread(fd, length, 8) if self.start <= self.size else b""
            header = json.loads(raw) if raw else {}
        except ValueError:  # safetensors' own reader says what is wrong
            header = {}
        self.header: dict[str, Any] = header if isinstance(header, dict) else {}

    def read_into(self, item: ReadItem, planner: LoadPlanner) -> bool:
        """Read ``item``'s slice straight into its target; False where it cannot be."""
        entry: Any = self.header.get(item.storage_index.fqn)
        target = planner.resolve_tensor(item).detach()
        try:
            dtype = codec.DTYPES[entry["dtype"]]
            shape = [int(n) for n in entry["shape"]]
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            return False
        offsets, lengths = list(item.storage_offsets), list(item.lengths)
        if (
            dtype != target.dtype
            or target.device.type != "cpu"
            or not target.is_contiguous()
            or len(offsets) != len(shape)
            or list(target.shape) != lengths
            or offsets[1:] != [0] * (len(shape) - 1)
            or lengths[1:] != shape[1:]
        ):
            return False
        itemsize = target.element_size()
        row = itemsize * math.prod(shape[1:])  # bytes of one index of the first dimension
        whole = shape[0] if shape else 1
        if begin < 0 or end - begin != row * whole or self.start + end > self.size:
            return False
        if shape and not 0 <= offsets[0] <= offsets[0] + lengths[0] <= shape[0]:
            return False
        first = self.start + begin + (offsets[0] * row if shape else 0)
        count = target.numel() * itemsize
        if count:
            view = target.reshape(-1).view(torch.uint8).numpy().data
            done = 0
            while done < count and (got := os.preadv(self.fd, [view[done:]], first + done)):
                done += got
            if done != count:
                raise OSError(errno.EIO, f"{item.storage_index.fqn}: {done} of {count} bytes read")
        planner.commit_tensor(item, target)
        return True

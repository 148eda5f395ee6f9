"""Sharded checkpoints (``SHARDED_STATE_DICT``): each rank writes and reads its own shards
through ``torch.distributed.checkpoint``.

A sharded model (``DTensor`` parameters: FSDP2) and its optimizer are saved as torch's
sharded state dicts (``torch.distributed.checkpoint.state_dict.get_model_state_dict`` /
``get_optimizer_state_dict``, default ``StateDictOptions``: each rank's ``DTensor`` shards,
keyed by parameter name), flattened (``flatten_state_dict``), split into their tensors, saved
by ``torch.distributed.checkpoint.save`` with ``DefaultSavePlanner`` into kwplug's staged
version folder through :class:`kwplug.checkpoint._dcp_storage.ShardWriter` (one streamed
safetensors file per rank, no pickle), and their other entries (the optimizer's
``param_groups``) stored as JSON by rank 0 (:mod:`kwplug.checkpoint._codec`). Loading
verifies every file against the manifest (xxh3-128 in 1 MiB chunks, one pass; the ranks
share the hashing: rank ``r`` hashes every ``world_size``-th file), then
``torch.distributed.checkpoint.load`` with ``DefaultLoadPlanner`` reads each rank's part of
every tensor through torch's ``HuggingFaceStorageReader``
(:class:`~kwplug.checkpoint._dcp_storage.ShardReader`), which rebuilds DCP's ``Metadata``
from the shards' headers: a checkpoint saved by any number of processes loads into any
other, and into an unsharded model (whose full tensors DCP reads under the same names),
exactly. ``set_model_state_dict`` / ``set_optimizer_state_dict`` then restore the live
objects. Every method that saves or loads is a collective.

``FULL_STATE_DICT`` (:mod:`kwplug.checkpoint._sharded`, gathered to rank 0) stays for small
models and export; the plugin that sharded the model selects it (its ``state_dict_type``).
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kwplug.checkpoint import _codec as codec
from kwplug.checkpoint import _layout as layout
from kwplug.checkpoint import _reader as reader
from kwplug.checkpoint import _sharded as sharded
from kwplug.checkpoint._checks import check_class, qualified_name
from kwplug.errors import CheckpointError

SHARDED = "SHARDED_STATE_DICT"
FULL = "FULL_STATE_DICT"


def state_dict_type(value: Any) -> str:
    """:data:`SHARDED` or :data:`FULL` for a plugin's ``state_dict_type`` (a name in any case,
    torch's ``StateDictType`` member or its number as a string, as Accelerate's
    ``FullyShardedDataParallelPlugin`` accepts); ``None`` is :data:`SHARDED`, Accelerate
    1.16's default for ``fsdp_version=2``.

    Raises:
        ValueError: anything else (``LOCAL_STATE_DICT`` included: FSDP2 has none).
    """
    if value is None:
        return SHARDED
    name = getattr(value, "name", value)
    name = {"1": FULL, "3": SHARDED}.get(name, name) if isinstance(name, str) else name
    if isinstance(name, str) and name.upper() in (SHARDED, FULL):
        return name.upper()
    raise ValueError(
        f"state_dict_type must be 'SHARDED_STATE_DICT' or 'FULL_STATE_DICT' (a name, or "
        f"torch.distributed.fsdp.StateDictType), got {value!r}"
    )


def _split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Any]:
    # The flattened state's tensors (DTensors too), its other entries, and how to unflatten.
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, mapping = flatten_state_dict(state)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in flat.items() if k not in tensors}, mapping


def _precheck(path: Path, record: tuple[int, str]) -> None:
    # A regular file of the manifest's size; one whose first bytes say pickle (or torch.save's
    # zip) is named as one, never read further. Every rank checks every shard file so (one
    # fstat and 16 bytes each) before it parses their headers, so that each names the file.
    fd = reader.open_regular(path, record[0])
    try:
        foreign = codec.foreign_format(os.pread(fd, 16, 0), record[0])
    finally:
        os.close(fd)
    if foreign is not None:
        raise CheckpointError(f"{path}: {foreign}", path)


def _verify(path: Path, record: tuple[int, str]) -> None:
    # :func:`_precheck`, then hashed in chunks against its manifest record.
    _precheck(path, record)
    reader.verify(path, record)


def _dcp_errors() -> tuple[type[BaseException], ...]:
    # DCP's CheckpointException, which gathers every rank's failure, is a BaseException.
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _described(exc: BaseException) -> str:
    # Each failing rank's exception (DCP's CheckpointException), without its traceback.
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return str(exc)
    return "; ".join(
        f"rank {rank}: {type(pair[0]).__name__}: {pair[0]}" for rank, pair in failures.items()
    )


def _check_coverage(metadata: Any, path: Path) -> None:
    # Each saved tensor's shards must lie inside it and hold as many elements as it has: a
    # shard file missing from a manifest that was rewritten without it is refused, never
    # loaded as the live tensor's values where it was.
    for name, saved in metadata.state_dict_metadata.items():
        size, chunks = tuple(getattr(saved, "size", ())), getattr(saved, "chunks", None)
        if chunks is None:
            continue
        inside = all(
            len(c.offsets) == len(size)
            and all(
                o >= 0 and o + n <= s for o, n, s in zip(c.offsets, c.sizes, size, strict=False)
            )
            for c in chunks
        )
        held = sum(math.prod(c.sizes) for c in chunks)
        if not inside or held != math.prod(size):
            raise CheckpointError(
                f"{path}: the shards of {name!r} hold {held} of its {math.prod(size)} elements"
                f"{'' if inside else ', some outside it'}: a shard file is missing or is not "
                "this checkpoint's",
                path,
            )


@contextlib.contextmanager
def _one_process(world: int) -> Iterator[None]:
    # DCP warns that it "assumes the intent" of a one-process save or load: it is kwplug's.
    with warnings.catch_warnings():
        if world == 1:
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _rank() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ShardedState:
    """One model's (or its optimizer's) state saved as shards: the ``sharded`` entries of
    :func:`kwplug.checkpoint._plan.entries` (collectives: every rank, in the same order)."""

    def __init__(self, prefix: str, kind: str) -> None:
        self.prefix, self.kind = prefix, kind
        self._other: dict[str, Any] | None = None  # what verify() read of other.state

    def live_state(self) -> dict[str, Any]:
        """torch's sharded state dict of the live object (its tensors are the live ones)."""
        raise NotImplementedError

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore ``state`` (as :meth:`live_state` returns it) into the live object."""
        raise NotImplementedError

    def check_saved(
        self, metadata: Any, path: Path, other: dict[str, Any], meta: dict[str, str]
    ) -> None:
        """Refuse saved tensors (DCP ``Metadata``) and other entries (``other``, read with
        its header ``meta``) that do not fit (before any object is loaded)."""

    def state_dict(self) -> dict[str, Any]:
        """torch's ``Stateful`` protocol: :meth:`live_state`."""
        return self.live_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``Stateful`` protocol: :meth:`set_state`."""
        self.set_state(state_dict)

    def save_into(self, staging: Path) -> tuple[dict[str, tuple[int, str]], str | None]:
        """Write this rank's shards (and, on rank 0, the other entries) into ``staging``.

        Returns:
            ``{file name: (size, checksum)}`` of what this rank wrote, and an error message or
            ``None`` (every rank gets DCP's error: ``save`` gathers them).
        """
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.state_dict_saver import save

        from kwplug.checkpoint._dcp_storage import ShardWriter

        rank, world = _rank()
        tensors, other, _ = _split(self.live_state())
        writer = ShardWriter(staging, self.prefix, rank, self.kind)
        try:
            with _one_process(world):
                save(
                    tensors, storage_writer=writer, planner=DefaultSavePlanner(), no_dist=world == 1
                )
        except _dcp_errors() as exc:  # DCP's CheckpointException carries every rank's failure
            return {}, f"writing the shards of {self.prefix} into {staging} failed: " + (
                _described(exc)
            )
        records = dict(writer.records)
        if rank == 0:
            name = layout.other_file(self.prefix)
            try:
                records[name] = codec.write_state(staging / name, other, {"class": self.kind})
            except (OSError, TypeError) as exc:
                return records, f"writing {staging / name} failed: {exc}"
        return records, None

    def files(self, records: dict[str, Any]) -> list[str]:
        """This state's shard files among the manifest's ``records``."""
        return sorted(
            n for n in records if layout.is_shard_file(n) and n.startswith(f"{self.prefix}-")
        )

    def verify(self, directory: Path, records: dict[str, tuple[int, str]]) -> None:
        """Verify this rank's share of the files against the manifest, read the other entries
        and check the saved tensors' names, shapes and dtypes (nothing is loaded).

        Raises:
            CheckpointError: a file is missing, altered, not a safetensors file (a pickle is
                named as one and never read), or the saved state does not fit.
        """
        rank, world = _rank()
        other = layout.other_file(self.prefix)
        if other not in records:
            raise CheckpointError(f"{directory / other} is missing from the checkpoint")
        names = self.files(records)
        for index, name in enumerate(names):  # this rank hashes its share, checks the rest
            check = _verify if index % world == rank else _precheck
            check(directory / name, records[name])
        state, meta = reader.read_state(directory / other, records[other])
        if not isinstance(state, dict):
            raise CheckpointError(f"{directory / other} does not hold a state's entries")
        from kwplug.checkpoint._dcp_storage import ShardReader

        try:
            metadata = ShardReader([directory / n for n in names]).read_metadata()
        except Exception as exc:  # safetensors' error: a header it cannot parse
            raise CheckpointError(
                f"the shards of {self.prefix} in {directory} (files another rank verifies "
                f"are named by that rank's error): {exc}"
            ) from exc
        _check_coverage(metadata, directory / self.prefix)
        self.check_saved(metadata, directory / self.prefix, state, meta)
        self._other = state

    def load_from(self, directory: Path, records: dict[str, Any]) -> None:
        """Read this rank's part of every saved tensor into the live object (after
        :meth:`verify`; a collective).

        Raises:
            CheckpointError: the saved state lacks a live entry, or holds other non-tensor
                entries (every rank raises together: DCP gathers the errors).
        """
        from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import load

        from kwplug.checkpoint._dcp_storage import ShardReader

        tensors, other, mapping = _split(self.live_state())
        saved = self._other if self._other is not None else {}
        _check_entries(directory / self.prefix, saved, other)  # checked in verify too
        files = [directory / n for n in self.files(records)]
        try:
            world = _rank()[1]
            with _one_process(world):
                load(
                    tensors,
                    storage_reader=ShardReader(files),
                    planner=DefaultLoadPlanner(),
                    no_dist=world == 1,
                )
        except _dcp_errors() as exc:  # DCP's CheckpointException: every rank's failure
            raise CheckpointError(
                f"loading {directory / self.prefix} failed: {_described(exc)}"
            ) from exc
        self.set_state(unflatten_state_dict({**tensors, **saved}, mapping))
        self._other = None


class ModelShards(ShardedState):
    """A model as torch's sharded state dict (plain tensors for an unsharded model)."""

    def __init__(self, index: int, module: torch.nn.Module) -> None:
        super().__init__(layout.sharded_prefix("model", index), qualified_name(module))
        self.module = module

    def live_state(self) -> dict[str, Any]:
        """``get_model_state_dict(module)``."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def set_state(self, state: dict[str, Any]) -> None:
        """``set_model_state_dict(module, state)`` (strict)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, state)

    def check_saved(
        self, metadata: Any, path: Path, other: dict[str, Any], meta: dict[str, str]
    ) -> None:
        """Refuse saved tensors whose names, full shapes or dtypes differ from the model's."""
        _compare(path, metadata, other, self.live_state(), "the model")


class OptimizerShards(ShardedState):
    """An optimizer of one model as torch's sharded optimizer state dict (by parameter name)."""

    def __init__(
        self, index: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        super().__init__(layout.sharded_prefix("optimizer", index), qualified_name(optimizer))
        self.module, self.optimizer = module, optimizer

    def live_state(self) -> dict[str, Any]:
        """``get_optimizer_state_dict(module, optimizer)`` (its state is created if empty)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        optimizer = sharded.torch_optimizer(self.optimizer)
        return dict(get_optimizer_state_dict(self.module, optimizer))

    def set_state(self, state: dict[str, Any]) -> None:
        """``set_optimizer_state_dict(module, optimizer, state)``."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        optimizer = sharded.torch_optimizer(self.optimizer)
        # A stateless optimizer's empty "state" has no leaf to flatten, so unflattening drops
        # it, and torch would then take the dict for its own flattened format.
        set_optimizer_state_dict(self.module, optimizer, {"state": {}, **state})

    def check_saved(
        self, metadata: Any, path: Path, other: dict[str, Any], meta: dict[str, str]
    ) -> None:
        """Refuse a state saved from another optimizer class, or whose parameter groups'
        entries or state tensors (names, full shapes) differ from this run's, before any
        object is loaded (an optimizer without state is left without it)."""
        check_class(path, meta.get("class"), self.kind)
        optimizer = sharded.torch_optimizer(self.optimizer)
        fresh = not optimizer.state
        try:  # live_state creates the state of a fresh optimizer (torch's zero-grad step)
            _compare(path, metadata, other, self.live_state(), "this run's optimizer")
        except CheckpointError:
            if fresh:
                optimizer.state.clear()
            raise


def _check_entries(path: Path, saved: dict[str, Any], live: dict[str, Any]) -> None:
    # The non-tensor entries (an optimizer's param_groups keys) must be the live object's.
    if set(saved) != set(live):
        missing = sorted(set(live) - set(saved)) or sorted(set(saved) - set(live))
        raise CheckpointError(
            f"{path}: the saved entries differ from this run's ({missing[:3]} ...): prepare the "
            "same objects as the run that saved it",
            path,
        )


def _compare(
    path: Path, metadata: Any, other: dict[str, Any], live: dict[str, Any], owner: str
) -> None:
    # The saved tensors (DCP ``Metadata``) and other entries against the live state: the same
    # names, full shapes and, for a model, dtypes; the same non-tensor entries.
    tensors, live_other, _ = _split(live)
    _check_entries(path, other, live_other)
    saved, model = metadata.state_dict_metadata, owner == "the model"
    noun = "tensor" if model else "state tensor"
    for name in sorted(set(tensors) ^ set(saved)):
        where = f"{owner} has no" if name in saved else "the checkpoint lacks"
        raise CheckpointError(f"{path}: {where} {noun} {name!r}", path)
    for name, tensor in tensors.items():
        size, dtype = tuple(saved[name].size), saved[name].properties.dtype
        if size != tuple(tensor.shape) or (model and dtype != tensor.dtype):
            was, now = f"{size}", f"{tuple(tensor.shape)}"
            if model:
                was, now = f"{was} {dtype}", f"{now} {tensor.dtype}"
            raise CheckpointError(f"{path}: {name!r} was saved as {was}, {owner}'s is {now}", path)

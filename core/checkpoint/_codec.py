"""State files without pickles: nested state as one safetensors file.

Written by ``safetensors.torch.save_file`` straight from the tensors (the file is never built
in memory), then fsynced and, at the same time, checksummed (``xxh3-128``, in a second thread
while ``fsync`` waits for the disk) over the bytes as written: the header read back from the
file (a few kilobytes) and each tensor's bytes from the memory ``save_file`` wrote them from,
at the offset the header gives it; the tensors' bytes are never read back from the file.
Read back by :mod:`kwplug.checkpoint._reader`.

A state (``state_dict()`` of a model, optimizer, scheduler, RNG...) is stored as a
safetensors file: its tensors under their key path (a model's state dict is a plain
safetensors state dict, readable by ``safetensors.torch.load_file``), everything else as JSON
in the file's metadata (key ``"kwplug"``). Only tensors, NumPy arrays and random states,
``None``, booleans, numbers, strings, lists, tuples and dicts are stored; anything else is
refused when saving. Reading never unpickles, so no file can run code.
"""

from __future__ import annotations

import errno
import json
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from kwplug._process.umask import follow_umask
from kwplug.checkpoint import _checksum as checksum

META_KEY = "kwplug"
_SCALARS = (type(None), bool, int, float, str)
#: safetensors' dtype names (its format's ``dtype`` field) and the torch dtypes they denote.
DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "C64": torch.complex64,
        "U64": getattr(torch, "uint64", None),
        "U32": getattr(torch, "uint32", None),
        "U16": getattr(torch, "uint16", None),
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
        "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "F8_E4M3FNUZ": getattr(torch, "float8_e4m3fnuz", None),
        "F8_E5M2FNUZ": getattr(torch, "float8_e5m2fnuz", None),
    }.items()
    if dtype is not None
}
# safetensors reports a failed write as "I/O error: ... (os error 28)" (Rust's io::Error).
_OS_ERROR = re.compile(r"os error (\d+)|code: (\d+)")


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()

    def tensor(self, value: torch.Tensor, path: str) -> str:
        name = path if path and path not in self.tensors else f"$t{len(self.tensors)}"
        tensor = value.detach().cpu()
        ptr = tensor.untyped_storage().data_ptr()
        if tensor.numel() == 0 or ptr in self._storages:  # safetensors refuses shared storage
            tensor = tensor.clone()
        else:
            self._storages.add(ptr)
        self.tensors[name] = tensor.contiguous()
        return name

    def encode(self, value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            return {"$t": self.tensor(value, path)}
        if isinstance(value, _SCALARS):
            return value
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in value):
                return {k: self.encode(v, _join(path, k)) for k, v in value.items()}
            return {
                "$d": [
                    [self.encode(k, ""), self.encode(v, _join(path, str(k)))]
                    for k, v in value.items()
                ]
            }
        if isinstance(value, list):
            return [self.encode(v, _join(path, str(i))) for i, v in enumerate(value)]
        if isinstance(value, tuple):  # torch.Size included
            return {"$tuple": [self.encode(v, _join(path, str(i))) for i, v in enumerate(value)]}
        return self._numpy(value, path)

    def _numpy(self, value: Any, path: str) -> Any:
        import numpy as np

        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray):
            as_int = value.dtype.kind in "ui" and value.dtype.itemsize <= 4  # widen uint32
            data = torch.from_numpy(value.astype(np.int64) if as_int else value.copy())
            return {"$np": self.tensor(data, path), "dtype": value.dtype.str}
        if isinstance(value, np.random.RandomState):
            return {"$np_random": self.encode(value.get_state(), path)}
        raise TypeError(
            f"cannot store a {type(value).__module__}.{type(value).__qualname__} at "
            f"{path or 'the top'}: checkpoints hold only tensors, NumPy arrays, None, bools, "
            "numbers, strings, lists, tuples and dicts (kwplug loads no pickles)"
        )


class _Paths(_Encoder):
    # The tensors of a state under the names a save gives them (the encoder's own walk):
    # only those named by their key path, never copied; NumPy values are skipped.
    def tensor(self, value: torch.Tensor, path: str) -> str:
        if path and path not in self.tensors:
            self.tensors[path] = value
        return path

    def _numpy(self, value: Any, path: str) -> Any:
        return None


def named_tensors(state: Any) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` (a live ``state_dict()``) by the name :func:`write_state`
    gives each in a file, for those named by their key path (``"0.weight"``,
    ``"state.0.momentum_buffer"``): the same tensor objects, not copies."""
    paths = _Paths()
    paths.encode(state, "")
    return paths.tensors


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def from_structure(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state that ``value`` (the JSON structure of a state file) and its ``tensors``
    describe. With ``meta`` tensors (shapes only) NumPy values stay tensors and random
    states their decoded fields: nothing reads their data."""
    if isinstance(value, list):
        return [from_structure(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "$t" in value:
        return tensors[value["$t"]]
    if "$d" in value:
        return {from_structure(k, tensors): from_structure(v, tensors) for k, v in value["$d"]}
    if "$tuple" in value:
        return tuple(from_structure(v, tensors) for v in value["$tuple"])
    if "$np" in value:
        import numpy as np

        tensor = tensors[value["$np"]]
        return tensor if tensor.is_meta else tensor.numpy().astype(np.dtype(value["dtype"]))
    if "$np_random" in value:
        import numpy as np

        state = from_structure(value["$np_random"], tensors)
        if any(isinstance(v, torch.Tensor) and v.is_meta for v in state):
            return state
        rng = np.random.RandomState()
        rng.set_state(state)
        return rng
    return {k: from_structure(v, tensors) for k, v in value.items()}


def write_state(path: Path, state: Any, extra: dict[str, str] | None = None) -> tuple[int, str]:
    """Write ``state`` as the safetensors file ``path``, tensor by tensor from their memory
    (``safetensors.torch.save_file``), fsync it and return its ``(size, checksum)``: the
    ``xxh3-128`` of the header read back and of the tensors' memory, in the file's order
    (:func:`checksum_written`), computed by a worker thread while ``fsync`` runs.

    Args:
        path: the file to create (in a version folder being staged).
        state: what to store (see the module docstring).
        extra: more metadata entries (``str`` to ``str``).

    Raises:
        TypeError: ``state`` holds something else, named by its key path.
        OSError: the write failed (``ENOSPC``: the disk is full), or the file is not what
            was written (``EIO``).
    """
    encoder = _Encoder()
    structure = encoder.encode(state, "")
    metadata = {META_KEY: json.dumps(structure), **(extra or {})}
    try:
        safetensors.torch.save_file(encoder.tensors, path, metadata=metadata)
    except safetensors.SafetensorError as exc:  # Rust's I/O error, as the OSError it is
        found = _OS_ERROR.search(str(exc))
        if found is None:
            raise OSError(errno.EIO, str(exc), str(path)) from None
        code = int(found.group(1) or found.group(2))
        raise OSError(code, os.strerror(code), str(path)) from None
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        follow_umask(fd)  # save_file's temporary file is 0600 whatever the umask
        # The checksum needs only memory, fsync only the disk: overlapped, the save costs
        # about the longer of the two. The pool is left (joined) before fd is closed.
        with ThreadPoolExecutor(1, thread_name_prefix="kwplug-hash") as pool:
            hashed = pool.submit(checksum_written, fd, encoder.tensors, path)
            os.fsync(fd)
            return hashed.result()
    finally:
        os.close(fd)


def checksum_written(fd: int, tensors: dict[str, torch.Tensor], path: Path) -> tuple[int, str]:
    """``(size, "xxh3-128:<hex>")`` of the safetensors file ``fd`` that ``save_file`` wrote
    from ``tensors``: its header read back from ``fd``, then each tensor's bytes from its
    memory in the order of the header's offsets, which must tile the rest of the file.

    Raises:
        OSError: ``EIO``: the header does not describe ``tensors`` back to back up to the
            file's end (the file is not what was written).
    """
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    length = struct.unpack("<Q", head)[0] if len(head) == 8 else size
    raw = os.pread(fd, length, 8) if length <= size - 8 else b""
    hashed = checksum.hasher(checksum.ALGORITHM)
    hashed.update(head + raw)
    try:
        header = json.loads(raw)
        spans = sorted(
            (int(v["data_offsets"][0]), int(v["data_offsets"][1]), k)
            for k, v in header.items()
            if k != "__metadata__"
        )
    except (ValueError, TypeError, KeyError, IndexError):
        spans = None
    done = 0
    for begin, end, name in spans if spans is not None and len(raw) == length else ():
        tensor = tensors.get(name)
        if tensor is None or (begin, end - begin) != (done, tensor.nbytes):
            break
        if tensor.nbytes:  # a view of the tensor's memory: no copy
            hashed.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
        done = end
    else:
        if spans is not None and len(spans) == len(tensors) and 8 + length + done == size:
            return size, f"{checksum.ALGORITHM}:{hashed.hexdigest()}"
    raise OSError(errno.EIO, "the file safetensors wrote is not the tensors given", str(path))


def foreign_format(head: bytes, size: int) -> str | None:
    """Why a file of ``size`` bytes starting with ``head`` (its first 9 bytes or more)
    cannot be a file kwplug wrote, when those bytes tell; else ``None``.

    Pickles (protocol 2 and later, so also ``torch.save``'s legacy format) start with the
    ``PROTO`` opcode ``0x80``; ``torch.save``'s zip archives (pickles inside) with ``PK``.
    A safetensors file starts with its header length (8 bytes, little-endian), whose first
    byte is ``0x80`` for one length in 256: it is recognised by the ``{`` its JSON header
    opens with at byte 8, and a length that fits the file, before the pickle check.
    """
    if len(head) >= 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] <= size - 8:
        return None
    if head[:1] == b"\x80":
        return "it looks like a pickle; kwplug never loads pickles"
    if head[:4] == b"PK\x03\x04":
        return "it looks like a torch.save zip archive (pickles inside); kwplug never loads pickles"
    return None


def write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with path.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())

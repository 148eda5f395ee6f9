"""State files without pickles: nested state as one safetensors file.

A state (``state_dict()`` of a model, optimizer, scheduler, RNG...) is stored as a
safetensors file: its tensors under their key path (a model's state dict is a plain
safetensors state dict, readable by ``safetensors.torch.load_file``), everything else as JSON
in the file's metadata (key ``"kwplug"``). Only tensors, NumPy arrays and random states,
``None``, booleans, numbers, strings, lists, tuples and dicts are stored; anything else is
refused when saving. Reading never unpickles, so no file can run code.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from kwplug.errors import CheckpointError

META_KEY = "kwplug"
_SCALARS = (type(None), bool, int, float, str)


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


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "$t" in value:
        return tensors[value["$t"]]
    if "$d" in value:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["$d"]}
    if "$tuple" in value:
        return tuple(_decode(v, tensors) for v in value["$tuple"])
    if "$np" in value:
        import numpy as np

        return tensors[value["$np"]].numpy().astype(np.dtype(value["dtype"]))
    if "$np_random" in value:
        import numpy as np

        rng = np.random.RandomState()
        rng.set_state(_decode(value["$np_random"], tensors))
        return rng
    return {k: _decode(v, tensors) for k, v in value.items()}


def encode(state: Any, extra: dict[str, str] | None = None) -> bytes:
    """The bytes of the safetensors file holding ``state``.

    Args:
        state: what to store (see the module docstring).
        extra: more metadata entries (``str`` to ``str``).

    Raises:
        TypeError: ``state`` holds something else, named by its key path.
    """
    encoder = _Encoder()
    structure = encoder.encode(state, "")
    metadata = {META_KEY: json.dumps(structure), **(extra or {})}
    return safetensors.torch.save(encoder.tensors, metadata=metadata)


def foreign_format(data: bytes) -> str | None:
    """Why ``data`` cannot be a file kwplug wrote, when its first bytes tell; else ``None``.

    Pickles (protocol 2 and later, so also ``torch.save``'s legacy format) start with the
    ``PROTO`` opcode ``0x80``; ``torch.save``'s zip archives (pickles inside) with ``PK``.
    A safetensors file starts with its header length (8 bytes, little-endian), whose first
    byte is ``0x80`` for one length in 256: it is recognised by the ``{`` its JSON header
    opens with at byte 8, and a length that fits the file, before the pickle check.
    """
    if len(data) >= 9 and data[8:9] == b"{" and struct.unpack("<Q", data[:8])[0] <= len(data) - 8:
        return None
    if data[:1] == b"\x80":
        return "it looks like a pickle; kwplug never loads pickles"
    if data[:4] == b"PK\x03\x04":
        return "it looks like a torch.save zip archive (pickles inside); kwplug never loads pickles"
    return None


def decode(data: bytes, file: Path) -> tuple[Any, dict[str, str]]:
    """The state and metadata in ``data``, the bytes of ``file``.

    Raises:
        CheckpointError: ``data`` is not a kwplug state file (naming ``file`` and why; no
            chained parser error: the message says all there is).
    """
    problem = foreign_format(data)
    if problem is None:
        try:
            (size,) = struct.unpack("<Q", data[:8])
            header = json.loads(data[8 : 8 + size].decode("utf-8"))
            metadata = header.get("__metadata__") or {}
            structure = json.loads(metadata[META_KEY])
            tensors = safetensors.torch.load(data)
            return _decode(structure, tensors), metadata
        except UnicodeDecodeError:
            problem = "its header is not UTF-8 text"
        except struct.error:
            problem = f"it has {len(data)} bytes, too few for a safetensors header"
        except Exception as exc:  # any other malformed content: say what the parser said
            problem = f"{type(exc).__name__}: {exc}"
    raise CheckpointError(
        f"{file} is not a state file kwplug wrote (safetensors with kwplug metadata): {problem}",
        file,
    )


def write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with path.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def digest(data: bytes) -> str:
    """The sha256 of ``data``, in hex."""
    return hashlib.sha256(data).hexdigest()

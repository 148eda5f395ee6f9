"""A state file's safetensors header checked and its tensors placed, whatever holds its bytes.

:func:`checked` reads a file through a :class:`Source`: its header (``read``), checked as
safetensors checks it (known dtypes, shapes, offsets back to back, ending at the file's end:
:func:`spans`), and its tensors (``tensors``), which the source places: meta tensors (shapes
only), views of verified bytes in memory (:func:`views`), or the live tensors a load reads
into (:mod:`kwplug.checkpoint._direct`). Nothing here reads a file or trusts it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from kwplug.checkpoint import _codec as codec
from kwplug.errors import CheckpointError

#: The largest safetensors header read (safetensors' own limit).
HEADER_LIMIT = 100_000_000
#: Tensors of fewer bytes are copied out of a decoded file, not viewed in it.
SMALL = 1 << 16


class Source(Protocol):
    """Where :func:`checked` reads a file's header (``read(count, offset)``) and gets its
    tensors (``tensors(start, entries)``: the data section starts at byte ``start``)."""

    def read(self, count: int, offset: int) -> bytes: ...

    def tensors(self, start: int, entries: dict[str, Any]) -> dict[str, torch.Tensor]: ...


def checked(path: Path, source: Source, size: int) -> tuple[Any, dict[str, str]]:
    """The state in the safetensors file ``path`` of ``size`` bytes that ``source`` reads.

    Raises:
        CheckpointError: it is not a state file kwplug wrote (saying why).
    """
    try:
        return _state(source, size)
    except _Malformed as exc:
        problem = str(exc)
    raise CheckpointError(
        f"{path} is not a state file kwplug wrote (safetensors with kwplug metadata): {problem}",
        path,
    )


class _Malformed(Exception):
    """Why a file is not a state file kwplug wrote."""


def _state(source: Source, size: int) -> tuple[Any, dict[str, str]]:
    # The state in the file ``source`` reads (``size`` bytes): its header, then its tensors
    # (``source.tensors(start, entries)``: the data section starts at byte ``start``).
    length, body = _header(source.read, size)
    try:
        metadata = body.get("__metadata__") or {}
        entries = {k: v for k, v in body.items() if k != "__metadata__"}
        decoded = source.tensors(8 + length, entries)
        structure = json.loads(metadata[codec.META_KEY])
        return codec.from_structure(structure, decoded), metadata
    except CheckpointError:
        raise
    except Exception as exc:  # any other malformed content: say what was found
        raise _Malformed(f"{type(exc).__name__}: {exc}") from None


def _header(read: Callable[[int, int], bytes], size: int) -> tuple[int, dict[str, Any]]:
    # The header's length and its JSON, read through ``read`` (bounded by the file).
    head = read(9, 0)
    problem = codec.foreign_format(head, size)
    if problem is not None:
        raise _Malformed(problem)
    if size < 8:
        raise _Malformed(f"it has {size} bytes, too few for a safetensors header")
    (length,) = struct.unpack("<Q", head[:8])
    if length > min(size - 8, HEADER_LIMIT):
        raise _Malformed(f"its header length {length} does not fit its {size} bytes")
    raw = read(length, 8)
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise _Malformed("its header is not UTF-8 text") from None
    except ValueError as exc:
        raise _Malformed(f"{type(exc).__name__}: {exc}") from None
    if not isinstance(body, dict):
        raise _Malformed("its header is not a JSON object")
    return length, body


def dtype_of(entry: dict[str, Any]) -> torch.dtype:
    return codec.DTYPES[entry["dtype"]]


def shape_of(entry: dict[str, Any]) -> list[int]:
    shape = [int(n) for n in entry["shape"]]
    if any(n < 0 for n in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    return shape


def spans(
    start: int, entries: dict[str, Any], size: int
) -> list[tuple[str, int, int, torch.dtype, list[int]]]:
    """``(name, begin, end, dtype, shape)`` of each tensor of a file of ``size`` bytes whose
    data section starts at byte ``start`` (``entries``: its safetensors header without
    ``__metadata__``), in file order, ``begin``/``end`` from the file's start: after the checks
    safetensors makes (a known dtype, offsets back to back from the data section's start to
    the file's end, each span the size of its shape).

    Raises:
        ValueError: a check fails (saying which); ``KeyError``/``TypeError`` for a malformed
            entry.
    """
    ordered = sorted(
        (int(e["data_offsets"][0]), int(e["data_offsets"][1]), n) for n, e in entries.items()
    )
    done, found = 0, []
    for begin, end, name in ordered:
        dtype, shape = dtype_of(entries[name]), shape_of(entries[name])
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if begin != done or end - begin != nbytes:
            raise ValueError(
                f"tensor {name!r} spans bytes {begin}-{end}, not {done}-{done + nbytes}"
            )
        found.append((name, start + begin, start + end, dtype, shape))
        done = end
    if start + done != size:
        raise ValueError(f"its tensors end at byte {start + done}, the file at {size}")
    return found


def views(data: torch.Tensor, start: int, entries: dict[str, Any]) -> dict[str, torch.Tensor]:
    # Each tensor as a view of the verified bytes (:func:`spans`). A span not aligned for its
    # dtype (never written by safetensors, which pads its header to 8 bytes) is copied rather
    # than viewed, and so is a tensor under SMALL bytes: torch.set_rng_state reads a state
    # tensor's storage from its start, ignoring the view's offset (torch 2.13), and small
    # states cost nothing to copy.
    tensors = {}
    for name, begin, end, dtype, shape in spans(start, entries, data.numel()):
        piece = data[begin:end]
        if begin % torch.empty((), dtype=dtype).element_size() or piece.numel() < SMALL:
            piece = piece.clone()
        tensors[name] = piece.view(dtype).reshape(shape)
    return tensors

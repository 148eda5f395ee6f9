"""Reading checkpoint files without trusting them and without holding them whole.

Every file is opened once (``O_NOFOLLOW | O_NONBLOCK``: a link is never followed, a FIFO
never waited on) and checked with ``fstat`` on that descriptor before a byte is read: a
regular file of exactly the size its manifest records, so that a planted 2 GiB (sparse)
file costs one ``fstat``. Hashes are computed in chunks of :data:`CHUNK` bytes
(``os.preadv`` into one reused buffer): verifying a file costs one megabyte of memory,
whatever its size.

A state file's tensors are decoded by safetensors (``safe_open`` with its ``pread``
backend: each tensor read into memory of its own, no page-cache mapping) from the same
inode (``/proc/self/fd/<fd>``), and its sha256 is computed over the very bytes decoded: the
8-byte header length and the header read from the descriptor, then each tensor's bytes at
the offset the hashed header gives it. A file changed in place after it was verified fails
that hash, so what is loaded is always what the manifest records.

Two threads share the work where it can be shared without holding more memory (``hashlib``
and ``preadv`` release the GIL): the first pass (:func:`read_states`) verifies two files at
a time (files decoded whole in the calling thread, the others hashed by a worker), and
decoding hashes tensor ``i`` in a worker thread while safetensors reads tensor ``i + 1``
(the updates run in order, in one thread: the digest is the file's).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import struct
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kwplug.checkpoint import _codec as codec
from kwplug.errors import CheckpointError

#: The largest safetensors header read (safetensors' own limit).
HEADER_LIMIT = 100_000_000
#: Files the first pass (:func:`read_states`) verifies at a time.
WORKERS = 2
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def open_regular(path: Path, size: int | None = None, limit: int | None = None) -> int:
    """A read-only descriptor of ``path``, a regular file of ``size`` (at most ``limit``)
    bytes, checked with ``fstat`` before anything is read; the caller closes it.

    Raises:
        CheckpointError: ``path`` is missing, a link, not a regular file (FIFO, device,
            folder), not ``size`` bytes long, or over ``limit`` bytes.
    """
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):  # a device is never even opened
            raise CheckpointError(f"{path} is not a regular file", path)
        fd = os.open(path, _FLAGS)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing", path) from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:  # swapped for a link since lstat
            raise
        raise CheckpointError(f"{path} is not a regular file", path) from None
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise CheckpointError(f"{path} is not a regular file", path)
        if size is not None and found.st_size != size:
            why = "truncated?" if found.st_size < size else "replaced or appended to?"
            raise CheckpointError(
                f"{path} has {found.st_size} bytes, the manifest says {size} ({why})", path
            )
        if limit is not None and found.st_size > limit:
            raise CheckpointError(f"{path} is larger than {limit} bytes", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: Path, limit: int) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes (the manifest).

    Raises:
        CheckpointError: as :func:`open_regular`.
    """
    fd = open_regular(path, limit=limit)
    try:
        return _pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)


def record(path: Path) -> tuple[int, str]:
    """``(size, sha256)`` of ``path``, a regular file (what a save hook wrote).

    Raises:
        CheckpointError: ``path`` is a link, a FIFO or anything but a regular file.
    """
    fd = open_regular(path)
    try:
        return codec.sha256(fd)
    finally:
        os.close(fd)


def verify(path: Path, expected: tuple[int, str]) -> None:
    """Check ``path`` against its manifest record ``(size, sha256)``, in chunks.

    Raises:
        CheckpointError: ``path`` is missing, not regular, truncated or altered.
    """
    fd = open_regular(path, expected[0])
    try:
        _compare(path, codec.sha256(fd), expected)
    finally:
        os.close(fd)


def _compare(path: Path, got: tuple[int, str], expected: tuple[int, str]) -> None:
    if got[0] != expected[0]:
        raise CheckpointError(
            f"{path} has {got[0]} bytes, the manifest says {expected[0]} (changed while read?)",
            path,
        )
    if got[1] != expected[1]:
        raise CheckpointError(f"{path} does not match its sha256 in the manifest", path)


def read_state(
    path: Path, expected: tuple[int, str], *, shapes_only: bool = False
) -> tuple[Any, dict[str, str]]:
    """The state and metadata in the state file ``path``, verified against ``expected``.

    Args:
        path: a file :func:`kwplug.checkpoint._codec.write_state` wrote.
        expected: its manifest record ``(size, sha256)``.
        shapes_only: verify the whole file (chunked sha256) but decode its tensors as
            ``meta`` tensors (shapes and dtypes, no data): for the checks that run before
            anything is loaded, without holding the file.

    Raises:
        CheckpointError: ``path`` is missing, not regular, not ``expected``'s size or hash,
            or not a state file kwplug wrote (naming why, with no chained parser error).
    """
    fd = open_regular(path, expected[0])
    try:
        if shapes_only:
            _compare(path, codec.sha256(fd), expected)
        try:
            return _state(fd, path, expected, shapes_only)
        except _Malformed as exc:
            problem = str(exc)
        if not shapes_only:  # a damaged file: say so, rather than how it is malformed
            _compare(path, codec.sha256(fd), expected)
    finally:
        os.close(fd)
    raise CheckpointError(
        f"{path} is not a state file kwplug wrote (safetensors with kwplug metadata): {problem}",
        path,
    )


def read_states(
    files: Sequence[tuple[Path, tuple[int, str], bool]], workers: int = WORKERS
) -> list[tuple[Any, dict[str, str]]]:
    """:func:`read_state` of each ``(path, expected, shapes_only)`` in ``files``, ``workers``
    files at a time, returned in the order given.

    The files decoded whole are read in the calling thread, those checked from their shapes
    (hashed only) by ``workers - 1`` threads meanwhile (``workers`` when none is decoded):
    decoded tensors are allocated where the load frees them and allocates the next file's
    (glibc keeps one heap per thread: tensors of a worker's heap, freed, would stay resident
    next to the main thread's, doubling the peak).

    Args:
        files: the files to verify, each with its manifest record and whether only its
            tensors' shapes are decoded (see :func:`read_state`).
        workers: files read at a time; default :data:`WORKERS` (2).

    Raises:
        CheckpointError: a file that fails, as :func:`read_state` says (the first of this
            thread's, else the first of the workers' in ``files`` order); anything else a
            worker raised (an ``OSError`` from the disk...) as a ``CheckpointError`` naming
            that file. Files not started yet are not read.
    """
    here = [i for i, file in enumerate(files) if not file[2]]
    there = [i for i, file in enumerate(files) if file[2]]
    threads = min(workers - (1 if here else 0), len(there))
    if len(files) <= 1 or threads < 1:
        return [_read_named(*file) for file in files]
    results: dict[int, tuple[Any, dict[str, str]]] = {}
    with ThreadPoolExecutor(threads, thread_name_prefix="kwplug-verify") as pool:
        futures = {i: pool.submit(_read_named, *files[i]) for i in there}
        try:
            for i in here:
                results[i] = _read_named(*files[i])
            for i, future in futures.items():
                results[i] = future.result()
        finally:  # after a failure, the files not started yet are not read
            for future in futures.values():
                future.cancel()
    return [results[i] for i in range(len(files))]


def _read_named(path: Path, expected: tuple[int, str], shapes_only: bool) -> Any:
    try:
        return read_state(path, expected, shapes_only=shapes_only)
    except CheckpointError:
        raise
    except Exception as exc:  # a reading thread's error names its file
        raise CheckpointError(
            f"{path} could not be read: {type(exc).__name__}: {exc}", path
        ) from exc


class _Malformed(Exception):
    """Why a file is not a state file kwplug wrote."""


def _state(
    fd: int, path: Path, expected: tuple[int, str], shapes_only: bool
) -> tuple[Any, dict[str, str]]:
    raw, body = _header(fd, expected[0])
    try:
        metadata = body.get("__metadata__") or {}
        entries = {k: v for k, v in body.items() if k != "__metadata__"}
        if shapes_only:
            tensors = {k: _meta(v) for k, v in entries.items()}
        else:
            tensors = _decode_tensors(fd, path, raw, entries, expected)
        structure = json.loads(metadata[codec.META_KEY])
        return codec.from_structure(structure, tensors), metadata
    except CheckpointError:
        raise
    except Exception as exc:  # any other malformed content: say what was found
        raise _Malformed(f"{type(exc).__name__}: {exc}") from None


def _pread(fd: int, count: int, offset: int) -> bytes:
    chunks = []
    while count > 0 and (chunk := os.pread(fd, count, offset)):
        chunks.append(chunk)
        count, offset = count - len(chunk), offset + len(chunk)
    return b"".join(chunks)


def _header(fd: int, size: int) -> tuple[bytes, dict[str, Any]]:
    # The header's bytes and its JSON, read from the descriptor (bounded by the file).
    head = _pread(fd, 9, 0)
    problem = codec.foreign_format(head, size)
    if problem is not None:
        raise _Malformed(problem)
    if size < 8:
        raise _Malformed(f"it has {size} bytes, too few for a safetensors header")
    (length,) = struct.unpack("<Q", head[:8])
    if length > min(size - 8, HEADER_LIMIT):
        raise _Malformed(f"its header length {length} does not fit its {size} bytes")
    raw = _pread(fd, length, 8)
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise _Malformed("its header is not UTF-8 text") from None
    except ValueError as exc:
        raise _Malformed(f"{type(exc).__name__}: {exc}") from None
    if not isinstance(body, dict):
        raise _Malformed("its header is not a JSON object")
    return raw, body


def _meta(entry: dict[str, Any]) -> torch.Tensor:
    return torch.empty(
        [int(n) for n in entry["shape"]], dtype=codec.DTYPES[entry["dtype"]], device="meta"
    )


def _decode_tensors(
    fd: int, path: Path, raw: bytes, entries: dict[str, Any], expected: tuple[int, str]
) -> dict[str, torch.Tensor]:
    digest = hashlib.sha256(struct.pack("<Q", len(raw)))
    digest.update(raw)
    done = 0  # bytes of the data section hashed so far
    tensors: dict[str, torch.Tensor] = {}
    source = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else os.fspath(path)
    hashing: list[Future[None]] = []  # in one worker thread, in order: tensor i is hashed
    with (  # while tensor i + 1 is read; left (joined) before the descriptor is closed
        ThreadPoolExecutor(1, thread_name_prefix="kwplug-hash") as pool,
        safe_open(source, framework="pt", backend="pread") as opened,
    ):
        names = list(opened.offset_keys())
        if sorted(names) != sorted(entries):
            raise ValueError("its tensors are not those its header names")
        for name in names:
            tensor = opened.get_tensor(name)
            entry = entries[name]
            begin, end = (int(n) for n in entry["data_offsets"])
            wanted = (codec.DTYPES[entry["dtype"]], [int(n) for n in entry["shape"]])
            if (tensor.dtype, list(tensor.shape)) != wanted or (begin, end - begin) != (
                done,
                tensor.nbytes,
            ):
                raise ValueError(
                    f"tensor {name!r} is not what the header says (changed while read?)"
                )
            if tensor.nbytes:  # a view of the decoded tensor: no copy
                data = tensor.reshape(-1).view(torch.uint8).numpy()
                hashing.append(pool.submit(digest.update, data))
            done += tensor.nbytes
            tensors[name] = tensor
        for future in hashing:
            _hashed(path, future)
    _compare(path, (8 + len(raw) + done, digest.hexdigest()), expected)
    return tensors


def _hashed(path: Path, future: Future[None]) -> None:
    # A failure of the hashing thread, as a refusal naming the file (never a partial digest).
    try:
        future.result()
    except Exception as exc:
        raise CheckpointError(
            f"{path} could not be verified: {type(exc).__name__}: {exc}", path
        ) from exc

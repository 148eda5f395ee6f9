"""Reading checkpoint files without trusting them, each byte read once per pass.

Every file is opened once (``O_NOFOLLOW | O_NONBLOCK``: a link is never followed, a FIFO
never waited on) and checked with ``fstat`` on that descriptor before a byte is read: a
regular file of exactly the size its manifest records, so that a planted 2 GiB (sparse)
file costs one ``fstat``. Its checksum (:mod:`kwplug.checkpoint._checksum`: ``xxh3-128``, or
``sha256`` for a format 2 manifest) is then computed one of two ways:

- to verify a file without decoding it (:func:`verify`, and the first pass of a load for the
  files decoded later), in chunks of :data:`CHUNK` bytes read into one reused buffer: one
  megabyte of memory whatever the file's size;
- to decode it (:func:`read_state`), in the same single read that decodes it: the whole file
  is read into one private buffer (anonymous memory, never a mapping of the file, which
  would change with it), each chunk hashed right after it is read (while in the CPU's
  cache), the checksum compared with the manifest's, and only then are the tensors built as
  views of that buffer at the offsets of its (checked) safetensors header: no copy, and what
  is loaded is exactly the bytes that matched. A file changed in place after that read is
  never seen.

``safetensors.torch.load`` is not used to decode: it copies every tensor out of the bytes
(``deserialize``), twice the file's memory at its peak; the header is checked as
safetensors checks it (:mod:`kwplug.checkpoint._decode`).

Two threads share the first pass where it can be shared without holding more memory
(``preadv`` and the hashers release the GIL): :func:`read_states` verifies two files at a
time (files decoded whole in the calling thread, the others hashed by a worker).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kwplug.checkpoint import _checksum as checksum
from kwplug.checkpoint import _decode as decode
from kwplug.checkpoint import _staging as staging
from kwplug.errors import CheckpointError

#: Files the first pass (:func:`read_states`) verifies at a time.
WORKERS = 2
#: Bytes read (then hashed) at a time.
CHUNK = checksum.CHUNK
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
        return pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)


def record(path: Path) -> tuple[int, str]:
    """``(size, checksum)`` of ``path``, a regular file (what a save hook wrote).

    Raises:
        CheckpointError: ``path`` is a link, a FIFO or anything but a regular file.
    """
    fd = open_regular(path)
    try:
        return checksum.of_file(fd)
    finally:
        os.close(fd)


def verify(path: Path, expected: tuple[int, str]) -> None:
    """Check ``path`` against its manifest record ``(size, checksum)``, in chunks.

    Raises:
        CheckpointError: ``path`` is missing, not regular, truncated or altered, or its
            record names an unknown checksum algorithm.
    """
    algorithm = algorithm_of(path, expected)
    fd = open_regular(path, expected[0])
    try:
        compare(path, checksum.of_file(fd, algorithm), expected)
    finally:
        os.close(fd)


def algorithm_of(path: Path, expected: tuple[int, str]) -> str:
    try:
        return checksum.split(expected[1])[0]
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}", path) from None


def compare(path: Path, got: tuple[int, str], expected: tuple[int, str]) -> None:
    if got[0] != expected[0]:
        raise CheckpointError(
            f"{path} has {got[0]} bytes, the manifest says {expected[0]} (changed while read?)",
            path,
        )
    if got[1] != expected[1]:
        algorithm = expected[1].partition(":")[0]
        raise CheckpointError(
            f"{path} does not match its checksum ({algorithm}) in the manifest", path
        )


def read_state(
    path: Path, expected: tuple[int, str], *, shapes_only: bool = False
) -> tuple[Any, dict[str, str]]:
    """The state and metadata in the state file ``path``, verified against ``expected``.

    Args:
        path: a file :func:`kwplug.checkpoint._codec.write_state` wrote.
        expected: its manifest record ``(size, checksum)``.
        shapes_only: verify the whole file (hashed in chunks) but decode its tensors as
            ``meta`` tensors (shapes and dtypes, no data): for the checks that run before
            anything is loaded, without holding the file. Otherwise the file is read once,
            whole, into memory, hashed as it is read, and decoded from those bytes.

    Raises:
        CheckpointError: ``path`` is missing, not regular, not ``expected``'s size or
            checksum, or not a state file kwplug wrote (naming why, with no chained parser
            error); its record names an unknown checksum algorithm.
    """
    algorithm = algorithm_of(path, expected)
    fd = open_regular(path, expected[0])
    try:
        if shapes_only:
            compare(path, checksum.of_file(fd, algorithm), expected)
            source: decode.Source = _Shapes(fd)
            return decode.checked(path, source, expected[0])
        source = _Bytes(_read_whole(fd, path, expected, algorithm))
    finally:
        os.close(fd)
    return decode.checked(path, source, expected[0])


class _Shapes:
    # A file's header read from its descriptor; its tensors as meta tensors (no data).
    def __init__(self, fd: int) -> None:
        self._fd = fd

    def read(self, count: int, offset: int) -> bytes:
        return pread(self._fd, count, offset)

    def tensors(self, start: int, entries: dict[str, Any]) -> dict[str, torch.Tensor]:
        shape, dtype = decode.shape_of, decode.dtype_of
        return {n: torch.empty(shape(e), dtype=dtype(e), device="meta") for n, e in entries.items()}


class _Bytes:
    # A file's verified bytes in memory; its tensors as views of them.
    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def read(self, count: int, offset: int) -> bytes:
        return self._data[offset : offset + count].numpy().tobytes()

    def tensors(self, start: int, entries: dict[str, Any]) -> dict[str, torch.Tensor]:
        return decode.views(self._data, start, entries)


def _read_whole(fd: int, path: Path, expected: tuple[int, str], algorithm: str) -> torch.Tensor:
    # The file's bytes in private memory (a uint8 tensor: :mod:`._staging`), each chunk hashed
    # right after it is read (while in the CPU's cache); refused unless they match the record.
    size = expected[0]
    data = staging.buffer(size)
    view = data.numpy().data
    hashed, offset = checksum.hasher(algorithm, path), 0
    with contextlib.suppress(OSError, AttributeError):  # a hint only
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_SEQUENTIAL)
    try:
        while offset < size and (count := os.preadv(fd, [view[offset : offset + CHUNK]], offset)):
            hashed.update(view[offset : offset + count])
            offset += count
    finally:
        view.release()
    compare(path, (offset, f"{algorithm}:{hashed.hexdigest()}"), expected)
    return data


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


def pread(fd: int, count: int, offset: int) -> bytes:
    chunks = []
    while count > 0 and (chunk := os.pread(fd, count, offset)):
        chunks.append(chunk)
        count, offset = count - len(chunk), offset + len(chunk)
    return b"".join(chunks)

"""The private memory a load reads each decoded file into, reused from file to file.

A file is decoded from a private copy of its bytes (anonymous memory, never a mapping of the
file, which would change with it: :mod:`kwplug.checkpoint._reader`). Making that memory is
most of a small load's cost on a virtual machine (the kernel zeroes and maps every page:
~0.9 s per GiB here with ``MAP_POPULATE``, against ~0.2 s to copy a GiB from the page cache),
so within one load (:func:`reusing`) a buffer whose decoded tensors are no longer referenced
(the model's, once ``load_state_dict`` has copied them into the parameters: torch's storage
use count says so) is read into again by the next file that fits, instead of making new
memory; its pages past that file are given back (``MADV_DONTNEED``), so that tensors left
viewing it (an optimizer's new state) hold only their own file's memory.

A buffer's pages are made in one call for the file read into it
(``madvise(MADV_POPULATE_WRITE)``, not a fault per page), the rest of its capacity when a
longer file needs it. Huge pages (``MADV_HUGEPAGE``) were measured and left out: 3x cheaper to
make in a process that had made and freed them before, but 2-5x slower and erratic in a fresh
process (the first load of a run), with no compaction or reclaim counted by the kernel.

The buffers are made ``capacity`` bytes long, the largest file the load decodes, so that the
first one fits every later file.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Iterator

import torch

#: Buffers of at least this many bytes are reused within a load.
HUGE = 1 << 21
_LOCAL = threading.local()
#: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14; Python's ``mmap`` has no name for it).
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _use_count(tensor: torch.Tensor) -> int | None:
    # How many tensors (and storages) share ``tensor``'s memory; None where torch has no
    # such count (then a buffer is never reused).
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else int(count(tensor.untyped_storage()._cdata))


class _Buffer:
    # One anonymous mapping as a uint8 tensor; ``idle`` once only this object holds it.
    def __init__(self, size: int) -> None:
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0)
        self.mapping = mmap.mmap(-1, max(size, 1), flags=flags)
        self.data = torch.frombuffer(self.mapping, dtype=torch.uint8)  # keeps it alive
        self.capacity = size
        self._alone = _use_count(self.data)

    def populate(self, size: int) -> None:
        # Make the pages of the first ``size`` bytes in one call, not one fault per page (2x
        # faster here); the rest of the capacity stays unmade until a longer file needs it.
        # Where the kernel cannot (before Linux 5.14), the read faults them in.
        end = min(-(-size // mmap.PAGESIZE) * mmap.PAGESIZE, len(self.mapping))
        if end:
            with contextlib.suppress(OSError):
                self.mapping.madvise(_POPULATE_WRITE, 0, end)

    def idle(self) -> bool:
        return self._alone is not None and _use_count(self.data) == self._alone

    def trim(self, size: int) -> None:
        # Give back the pages past ``size`` (a previous, longer file's).
        start = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        if start < self.capacity and hasattr(mmap, "MADV_DONTNEED"):
            with contextlib.suppress(OSError):
                self.mapping.madvise(mmap.MADV_DONTNEED, start, self.capacity - start)


class _Pool:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffers: list[_Buffer] = []

    def take(self, size: int) -> torch.Tensor:
        idle = [b for b in self.buffers if b.idle()]
        chosen = next((b for b in idle if b.capacity >= size), None)
        # Idle buffers not chosen are dropped: their memory goes back before this read.
        self.buffers = [b for b in self.buffers if b is chosen or b not in idle]
        if chosen is None:
            chosen = _Buffer(max(size, self.capacity))
            self.buffers.append(chosen)
        else:
            chosen.trim(size)
        chosen.populate(size)
        return chosen.data[:size]


def buffer(size: int) -> torch.Tensor:
    """``size`` bytes of private, writable memory (a uint8 tensor): an idle buffer of the
    current :func:`reusing` block of this thread when one fits, else a new mapping."""
    pool: _Pool | None = getattr(_LOCAL, "pool", None)
    if pool is None or size < HUGE:
        made = _Buffer(size)
        made.populate(size)
        return made.data[:size]
    return pool.take(size)


@contextlib.contextmanager
def reusing(capacity: int = 0) -> Iterator[None]:
    """Within this block, files read by this thread reuse idle buffers (see the module
    docstring); ``capacity``: bytes of each buffer made (the largest file to decode)."""
    previous = getattr(_LOCAL, "pool", None)
    _LOCAL.pool = _Pool(capacity)
    try:
        yield
    finally:
        _LOCAL.pool = previous


def expect(size: int) -> None:
    """Make the buffers of this thread's :func:`reusing` block at least ``size`` bytes long
    (the largest file the load decodes: known once its manifest is read)."""
    pool: _Pool | None = getattr(_LOCAL, "pool", None)
    if pool is not None:
        pool.capacity = max(pool.capacity, size)

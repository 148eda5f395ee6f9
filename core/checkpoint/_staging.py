"""The private memory a load reads each decoded file into, reused from file to file.

A file is decoded from a private copy of its bytes (anonymous memory, never a mapping of the
file, which would change with it: :mod:`kwplug.checkpoint._reader`). Making that memory is
most of a load's cost on a virtual machine (the kernel zeroes and maps every page: ~1 s per
GiB in 4 KiB pages here, against ~0.2 s to copy a GiB from the page cache), so:

- a buffer of at least :data:`HUGE` bytes is backed by transparent huge pages
  (``madvise(MADV_HUGEPAGE)``: one fault per 2 MiB, ~5x cheaper to make here), faulted in by
  the read itself; where the kernel has no huge pages, it is populated at once
  (``MAP_POPULATE``), as before;
- within one load (:func:`reusing`), a buffer whose decoded tensors are no longer referenced
  (the model's, once ``load_state_dict`` has copied them into the parameters: torch's storage
  use count says so) is read into again by the next file that fits, instead of making new
  memory; its pages past that file are given back (``MADV_DONTNEED``), so that tensors left
  viewing it (an optimizer's new state) hold only their own file's memory.

The buffers are made ``capacity`` bytes long (virtual: pages not touched cost nothing), the
largest file the load decodes, so that the first one fits every later file.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

#: Buffers of at least this many bytes get huge pages and are reused within a load.
HUGE = 1 << 21
_LOCAL = threading.local()
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_pages() -> bool:
    # "always [madvise] never": huge pages unless the kernel says [never] (or has none).
    try:
        return "[never]" not in _THP.read_text() and hasattr(mmap, "MADV_HUGEPAGE")
    except OSError:
        return False


_HUGE_PAGES = _huge_pages()


def _use_count(tensor: torch.Tensor) -> int | None:
    # How many tensors (and storages) share ``tensor``'s memory; None where torch has no
    # such count (then a buffer is never reused).
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else int(count(tensor.untyped_storage()._cdata))


class _Buffer:
    # One anonymous mapping as a uint8 tensor; ``idle`` once only this object holds it.
    def __init__(self, size: int) -> None:
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0)
        huge = _HUGE_PAGES and size >= HUGE
        if not huge:  # 4 KiB pages: made in one call, not faulted one by one (2x faster)
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        self.mapping = mmap.mmap(-1, max(size, 1), flags=flags)
        if huge:
            with contextlib.suppress(OSError):
                self.mapping.madvise(mmap.MADV_HUGEPAGE)
        self.data = torch.frombuffer(self.mapping, dtype=torch.uint8)  # keeps it alive
        self.capacity = size
        self._alone = _use_count(self.data)

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
        return chosen.data[:size]


def buffer(size: int) -> torch.Tensor:
    """``size`` bytes of private, writable memory (a uint8 tensor): an idle buffer of the
    current :func:`reusing` block of this thread when one fits, else a new mapping."""
    pool: _Pool | None = getattr(_LOCAL, "pool", None)
    if pool is None or size < HUGE:
        return _Buffer(size).data[:size]
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

"""The advisory lock that keeps two savers out of one checkpoint directory.

``DIR/.kwplug.lock`` is locked with ``fcntl.flock`` (exclusive, non-blocking) and names its
holder (``host`` and ``pid``, JSON). The kernel releases the lock when its holder dies, so
the file of a dead process is a stale lock that the next saver simply takes over; a live
holder makes the second saver fail with an error naming host and pid. The file stays (it is
kwplug's); only its content changes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from kwplug.checkpoint import _layout as layout
from kwplug.errors import CheckpointError


def _holder(path: Path) -> str:
    try:
        owner = json.loads(path.read_text() or "{}")
        return f"host {owner.get('host', '?')}, pid {owner.get('pid', '?')}"
    except (OSError, ValueError):
        return "an unknown process"


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[Path]:
    """Hold the save lock of checkpoint ``directory`` (created if missing) for the block.

    Raises:
        CheckpointError: another live process holds the lock (naming its host and pid).
    """
    path = directory / layout.LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(
                f"another process is saving a checkpoint into {directory} "
                f"({_holder(path)} holds {path}); two runs must not share a checkpoint "
                "directory",
                path,
            ) from None
        owner = json.dumps({"host": socket.gethostname(), "pid": os.getpid()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, owner.encode(), 0)
        os.fsync(fd)
        yield path
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock

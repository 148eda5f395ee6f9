"""File modes that follow the process's umask.

Some writers kwplug uses create their files with mode ``0600`` whatever the umask
(``safetensors.torch.save_file`` writes through a private temporary file and renames it), so a
teammate's job that reads a shared checkpoint fails with ``PermissionError``. kwplug's own
files (``MANIFEST.json``, the run tag) are created with ``0o666`` filtered by the umask, as
``open()`` creates files; :func:`follow_umask` gives the other writers' files the same mode.
"""

from __future__ import annotations

import os
import threading

_LOCK = threading.Lock()


def current_umask() -> int:
    """The process's umask (e.g. ``0o022``).

    Read from ``/proc/self/status`` (Linux 4.7 and later), which changes nothing; elsewhere
    ``os.umask`` is set and restored at once under a lock (the only portable way to read it).
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode ``open()`` would give a new file now: ``0o666`` without the umask's bits."""
    return 0o666 & ~current_umask()


def follow_umask(fd: int) -> None:
    """Give the open file ``fd`` the mode ``open()`` would have created it with.

    Raises:
        OSError: ``fchmod`` failed (e.g. the file belongs to another user).
    """
    os.fchmod(fd, file_mode())

"""The commit protocol: how a checkpoint directory is written, found and replaced.

Every file is written under a temporary name, flushed, fsynced and renamed. A save into an
existing ``DIR`` builds ``DIR.partial`` first and swaps it in only when complete (the previous
checkpoint is kept as ``DIR.previous`` during the swap).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from kwplug.checkpoint import layout


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` to ``path`` via a fsynced temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_marker(directory: Path) -> None:
    """Write the completion marker last, durably."""
    tmp = directory / f".{layout.MARKER}.tmp"
    with tmp.open("w") as fh:
        fh.write("kwplug checkpoint\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, directory / layout.MARKER)
    _fsync_dir(directory)


def is_complete(directory: Path) -> bool:
    """True when ``directory`` holds a finished checkpoint."""
    return (directory / layout.MARKER).is_file()


def resolve_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint saved as ``directory``, or ``None`` when there is none.

    Falls back to ``DIR.previous`` when a crash interrupted the swap of a new checkpoint.
    """
    path = Path(directory)
    for candidate in (path, layout.previous_dir(path)):
        if is_complete(candidate):
            return candidate
    return None


def prepare_staging(directory: Path) -> Path:
    """Create an empty staging directory for ``directory`` (main process only)."""
    staging = layout.staging_dir(directory)
    if staging.exists():
        shutil.rmtree(staging)  # left over from a crashed save
    staging.mkdir(parents=True)
    return staging


def commit(directory: Path) -> None:
    """Swap the complete staging directory in as ``directory`` (main process only)."""
    staging = layout.staging_dir(directory)
    write_marker(staging)
    previous = layout.previous_dir(directory)
    if previous.exists():
        shutil.rmtree(previous)
    if directory.exists():
        os.replace(directory, previous)
    os.replace(staging, directory)
    _fsync_dir(directory.parent)
    if previous.exists():
        shutil.rmtree(previous)

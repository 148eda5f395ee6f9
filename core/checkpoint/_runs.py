"""Which run saved a ``checkpoint_<n>`` folder of automatic naming.

Two runs may share a ``project_dir`` (a second experiment started next to the first, a run
restarted without ``load_state``). So that one never prunes, or resumes, the other's
checkpoints, each ``save_state()`` with automatic naming tags the folder it wrote with the
run's id, in ``checkpoint_<n>/.kwplug-run`` (JSON ``{"run": "<32 hex digits>"}``, replaced
atomically), written while the save holds the folder's lock, before its commit, so that a save
killed right after its commit is tagged too (retried after the commit when that failed). The
id is the Accelerator's :class:`RunIdentity`: new for each Accelerator, and taken over from
the checkpoint a ``load_state`` reads (a resumed run is the run that saved it, and goes on
pruning its older checkpoints).

A folder without a tag (saved by kwplug before tags) belongs to no run in particular: every
run counts it as its own, and a ``load_state`` of it continues the only run whose tagged
checkpoints are next to it, if there is one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import uuid
from pathlib import Path

import attrs

RUN_FILE = ".kwplug-run"
_RUN_TMP = ".kwplug-run.tmp"
_MAX_BYTES = 4096
_ID = re.compile(r"[0-9a-f]{32}")


def _new_id() -> str:
    return uuid.uuid4().hex


@attrs.define
class RunIdentity:
    """The id a run tags its automatic checkpoints with (one per Accelerator).

    Attributes:
        id: 32 hex digits; new for each Accelerator, replaced by the id of the checkpoint a
            ``load_state`` of ``checkpoints/checkpoint_<n>`` reads.
    """

    id: str = attrs.field(factory=_new_id)


def is_run_file(name: str) -> bool:
    """True for the tag's name (and its temporary name) inside a ``checkpoint_<n>`` folder."""
    return name in (RUN_FILE, _RUN_TMP)


def owner(folder: Path) -> str | None:
    """The id of the run that saved ``folder``, or ``None`` without a readable tag (a link,
    a FIFO, anything but a small regular file of kwplug's JSON is no tag)."""
    try:
        fd = os.open(folder / RUN_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_BYTES:
            return None
        data = os.read(fd, _MAX_BYTES)
    finally:
        os.close(fd)
    try:
        run = json.loads(data).get("run")
    except (ValueError, AttributeError):
        return None
    return run if isinstance(run, str) and _ID.fullmatch(run) else None


def tag(folder: Path, run_id: str) -> None:
    """Record ``run_id`` as the run that saved ``folder`` (a temporary file, renamed).

    Raises:
        OSError: the tag could not be written.
    """
    tmp = folder / _RUN_TMP
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a killed tag's leftover (unlink never follows a link)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        try:
            os.write(fd, json.dumps({"run": run_id}).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, folder / RUN_FILE)
    except BaseException:  # a full disk: no half-written tag left behind
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def short(run_id: str | None) -> str:
    """A run's id as messages show it (its first 8 digits; ``untagged`` without one)."""
    return f"run {run_id[:8]}" if run_id else "untagged"

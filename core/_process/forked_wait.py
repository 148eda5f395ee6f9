"""Waiting for the jobs of :mod:`kwplug._process.forked`, and stopping their ranks."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from multiprocessing.process import BaseProcess
from pathlib import Path


def wake_stopped(folder: Path) -> None:
    """Once a rank has failed, send ``SIGCONT`` to every rank's process group: torch's agent
    ``SIGTERM``s the other ranks and ``SIGKILL``s them only 30 s later, and a rank stopped by
    ``SIGSTOP`` is not woken by ``SIGTERM`` (``SIGCONT`` to a running process does nothing)."""
    if not any(folder.glob("failed_*")):
        return
    for pid_file in folder.glob("pid_*"):
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
            os.killpg(int(pid_file.read_text()), signal.SIGCONT)


def wait(
    job: threading.Thread | BaseProcess, timeout: float, folder: Path, poll: bool = False
) -> bool:
    """Wait for ``job`` at most ``timeout`` seconds (with ``poll``, waking stopped ranks once
    one failed); whether it ran past them (then the processes it started are killed)."""
    deadline = time.monotonic() + timeout
    try:
        while job.is_alive() and (left := deadline - time.monotonic()) > 0:
            job.join(min(left, 0.1) if poll else left)
            if poll:
                wake_stopped(folder)
    except BaseException:  # the caller was interrupted (a test's own timeout): no orphans
        stop_ranks(folder)
        raise
    if not job.is_alive():
        return False
    stop_ranks(folder)
    job.join(30.0)
    return True


def stop_ranks(folder: Path) -> None:
    """``SIGTERM``, then ``SIGKILL``, to the process group of every rank in ``folder``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid_file in folder.glob("pid_*"):
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                os.killpg(int(pid_file.read_text()), sig)
        if sig == signal.SIGTERM:
            threading.Event().wait(2.0)

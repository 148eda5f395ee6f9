"""``python *args`` as a new process for tests, started in a fraction of a second.

The process is forked from the server that imported torch once (``kwplug._process.forked``) and then
given the environment, import path, ``sys.argv``, working folder, exit handlers and exit
status a new interpreter would have; kwplug and everything but torch is imported afresh. When
the environment changes what an interpreter reads only at start-up, a real interpreter runs.
Tests of what only a real process shows (being killed, C++ teardown at exit) use
``subprocess`` directly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from kwplug._process import forked as _forked


def python(
    *args: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 300.0,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """As ``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)``:
    ``args`` is ``"-c", code, ...``, ``"-m", module, ...`` or ``script, ...``; ``env`` the
    whole environment (default: this process's), with ``OMP_NUM_THREADS=1`` unless given.

    Raises:
        subprocess.TimeoutExpired: after ``timeout`` seconds (the process group is killed).
        subprocess.CalledProcessError: ``check`` and a non-zero exit status.
    """
    argv = [os.fspath(a) for a in args]
    cmd = [sys.executable, *argv]
    full = {"OMP_NUM_THREADS": "1", **(os.environ if env is None else env)}
    where = os.fspath(cwd) if cwd is not None else None
    if argv[:1] in (["-c"], ["-m"]) and len(argv) >= 2:
        mode: _forked.Mode = "code" if argv[0] == "-c" else "module"
        target, rest = argv[1], argv[2:]
    elif argv and not argv[0].startswith("-"):
        mode, target, rest = "script", str(Path(where or ".", argv[0])), argv[1:]
    else:
        mode = None  # other interpreter options: a real interpreter
    if mode is None or not _forked.forkable(full):
        return subprocess.run(
            cmd, capture_output=True, text=True, env=full, cwd=where, timeout=timeout, check=check
        )
    with tempfile.TemporaryDirectory(prefix="kwplug-python-") as folder:
        done = _forked.run_single(
            mode, target, rest, env=full, timeout=timeout, folder=Path(folder), cwd=where
        )
    if done.timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=done.stdout, stderr=done.stderr)
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)
    return subprocess.CompletedProcess(cmd, done.returncode, done.stdout, done.stderr)

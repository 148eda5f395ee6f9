"""Run a script in N CPU processes under torchrun (gloo, 127.0.0.1, a free port), bounded."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kwplug._process import forked as _forked
from kwplug.testing.distributed import child_environment, free_port


def torchrun(
    script: str | Path,
    *args: str,
    nproc: int = 2,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    torchrun_args: Sequence[str] = (),
    check: bool = True,
    elastic: bool = False,
    cli: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m torch.distributed.run --nproc-per-node nproc script *args``.

    One thread per process (OMP_NUM_THREADS=1) so two ranks share two cores fairly. By
    default torch's elastic agent starts the ranks from a server that imported torch once
    (``kwplug.testing.run_torchrun``: the same ranks, environment and exit status, in a
    fraction of the start-up time). The command line runs instead with ``torchrun_args``,
    with ``elastic`` (rendezvous through torchrun's c10d backend, which restarted workers
    need: the static rendezvous can leave a restarted gloo group waiting for the previous
    attempt's peers), or with ``cli`` (what happens when a real interpreter exits is under
    test). Raises ``AssertionError`` with both output streams when ``check`` and the run
    failed, and ``subprocess.TimeoutExpired`` after ``timeout`` seconds (the ranks are
    killed).
    """
    port = free_port()
    rendezvous = (
        ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
        if elastic
        else ["--master-addr=127.0.0.1", f"--master-port={port}"]
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        *rendezvous,
        *torchrun_args,
        str(script),
        *args,
    ]
    full_env = child_environment(env)
    if cli or elastic or torchrun_args or not _forked.forkable(full_env):
        result = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=full_env, check=False
        )
    else:
        with tempfile.TemporaryDirectory(prefix="kwplug-torchrun-") as folder:
            done = _forked.launch(
                "script",
                str(script),
                [str(a) for a in args],
                nproc=nproc,
                port=port,
                env=full_env,
                timeout=timeout,
                folder=Path(folder),
            )
        if done.timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, output=done.stdout, stderr=done.stderr)
        result = subprocess.CompletedProcess(cmd, done.returncode, done.stdout, done.stderr)
    if check and result.returncode != 0:
        raise AssertionError(
            f"torchrun failed ({result.returncode}): {' '.join(cmd)}\n"
            f"--- stdout ---\n{result.stdout[-8000:]}\n--- stderr ---\n{result.stderr[-8000:]}"
        )
    return result

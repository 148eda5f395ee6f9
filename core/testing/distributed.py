"""Run a function in N CPU processes under ``torchrun`` (gloo on 127.0.0.1), bounded in time.

This is PyTorch's own launcher -- its elastic agent, which ``python -m torch.distributed.run``
runs, with a static rendezvous on a free local port -- started in the calling process with the
ranks forked from a server that imported torch once (``kwplug._process.forked``), or the
``torchrun`` command line when torchrun options are given. kwplug adds only the plumbing a test
needs: the function is named by its import path, its arguments and every rank's return value
travel as pickles through a temporary folder, and a failure or a timeout raises with what each
rank printed.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kwplug._process import forked as _forked
from kwplug.errors import DistributedRunError
from kwplug.testing.sandbox import active_environment
from kwplug.validators import is_int

#: Environment variables of an enclosing torchrun job that must not leak into the child job.
_TORCHRUN_VARIABLES = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_command(
    target: Sequence[str], *, nproc: int = 2, torchrun_args: Sequence[str] = ()
) -> list[str]:
    """``python -m torch.distributed.run`` for ``nproc`` local processes and a free port.

    Args:
        target: what torchrun runs: ``["script.py", *args]`` or ``["-m", "module", *args]``.
        nproc: processes on this node (``--nproc-per-node``), >= 1.
        torchrun_args: extra torchrun options (e.g. ``["--max-restarts=1"]``); a
            ``--rdzv-backend`` option replaces the default static rendezvous.

    Raises:
        ValueError: ``nproc < 1``.
    """
    if not is_int(nproc) or nproc < 1:
        raise ValueError(f"nproc must be an int >= 1, got {nproc!r}")
    rendezvous: list[str] = []
    if not any(a.startswith("--rdzv-backend") for a in torchrun_args):
        rendezvous = ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        *rendezvous,
        *torchrun_args,
        *target,
    ]


def child_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child torchrun job: one thread per process
    (``OMP_NUM_THREADS=1``, so ranks share the cores fairly), the enclosing job's torchrun
    variables removed, then ``env`` on top."""
    full = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in _TORCHRUN_VARIABLES:
        full.pop(name, None)
    full.update(env or {})
    return full


def run_bounded(
    cmd: Sequence[str], *, timeout: float, env: Mapping[str, str], cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (stdout and stderr together) in its own session, bounded in time.

    After ``timeout`` seconds torchrun gets ``SIGTERM`` (it stops its workers), then the
    session gets ``SIGKILL``, and :class:`DistributedRunError` is raised with the output so
    far. Output goes to a file, not a pipe, so a stray worker cannot keep the caller waiting.
    """
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
            text=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            out.seek(0)
            raise DistributedRunError(
                f"timed out after {timeout:g} s: {' '.join(cmd)}\n--- output ---\n"
                f"{out.read()[-8000:]}"
            ) from None
        out.seek(0)
        return subprocess.CompletedProcess(list(cmd), proc.returncode, out.read(), "")


def _stop(proc: subprocess.Popen[str]) -> None:
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_torchrun(
    target: Sequence[str],
    *,
    nproc: int = 2,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    torchrun_args: Sequence[str] = (),
    cwd: str | None = None,
    folder: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``target`` (``["script.py", *args]`` or ``["-m", "module", *args]``) in ``nproc``
    ranks as ``torchrun`` would (gloo-ready torchrun variables, 127.0.0.1, a free port, one
    thread per process) and return its exit status and output; a failure is not raised.

    Without ``torchrun_args``, the ranks are started by torch's elastic agent
    (``torch.distributed.launcher.api.elastic_launch``, what ``torchrun`` runs) in this
    process, forked from a server that imported torch once: a job starts in a fraction of a
    second instead of the seconds three fresh interpreters spend importing torch. Each rank's
    environment, import path, ``sys.argv``, working folder, exit handlers and exit status are
    those of the process torchrun would have started (``kwplug._process.forked``). With
    ``torchrun_args`` (restarts, another rendezvous), or an ``env`` that changes what an
    interpreter reads only when it starts (``PYTHONHASHSEED``, ``PYTHONWARNINGS``,
    ``OMP_NUM_THREADS``...), the ``python -m torch.distributed.run`` command line runs
    instead.

    Args:
        target: the script and its arguments, or ``"-m"``, a module name and its arguments.
        nproc: number of ranks (``--nproc-per-node``), default 2.
        timeout: seconds for the whole job (default 120); then the ranks are killed.
        env: extra environment variables (on top of :func:`child_environment`).
        torchrun_args: extra torchrun options; any forces the torchrun command line.
        cwd: the ranks' working folder (default: this process's).
        folder: where the forked ranks' logs go (default: a temporary folder, removed after).

    Returns:
        ``CompletedProcess`` with torchrun's exit status (0, or 1 when a rank failed) and,
        in ``stdout``, what the ranks wrote to stdout and stderr.

    Raises:
        ValueError: ``nproc < 1`` or an empty ``target``.
        DistributedRunError: the job ran past ``timeout`` (the message holds its output).
    """
    if not target or (target[0] == "-m" and len(target) < 2):
        raise ValueError(f"target must name a script or '-m module', got {list(target)!r}")
    cmd = torchrun_command(target, nproc=nproc, torchrun_args=torchrun_args)
    full_env = child_environment(env)
    if torchrun_args or not _forked.forkable(full_env):
        return run_bounded(cmd, timeout=timeout, env=full_env, cwd=cwd)
    module = target[0] == "-m"
    mode: _forked.Mode = "module" if module else "script"
    name, argv = (target[1], target[2:]) if module else (target[0], target[1:])
    with contextlib.ExitStack() as stack:
        where = folder or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kwplug-")))
        finished = _forked.launch(
            mode,
            os.fspath(name),
            [os.fspath(a) for a in argv],
            nproc=nproc,
            port=free_port(),
            env=full_env,
            timeout=timeout,
            folder=where,
            cwd=cwd,
        )
    if finished.timed_out:
        raise DistributedRunError(
            f"timed out after {timeout:g} s: {' '.join(cmd)}\n--- output ---\n"
            f"{finished.output[-8000:]}"
        )
    return subprocess.CompletedProcess(cmd, finished.returncode, finished.output, "")


def run_script(
    script: str | os.PathLike[str],
    *args: str,
    nproc: int = 2,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    torchrun_args: Sequence[str] = (),
) -> str:
    """Run ``python -m torch.distributed.run --nproc-per-node nproc script *args`` (gloo on
    127.0.0.1, a free port, one thread per process) and return its output.

    Inside an active :class:`~kwplug.testing.PluginSandbox` the processes see the sandbox's
    plugins, as with :func:`run_distributed`.

    Returns:
        stdout and stderr of the job, interleaved.

    Raises:
        DistributedRunError: the job exited with an error or ran past ``timeout`` seconds
            (the message holds the output).
    """
    result = run_torchrun(
        [os.fspath(script), *args],
        nproc=nproc,
        timeout=timeout,
        env={**active_environment(), **(env or {})},
        torchrun_args=torchrun_args,
    )
    if result.returncode != 0:
        raise DistributedRunError(
            f"{' '.join(result.args)} exited with status {result.returncode}\n--- output ---\n"
            f"{result.stdout[-8000:]}",
            returncode=result.returncode,
        )
    return result.stdout


def importable_name(fn: Callable[..., Any]) -> tuple[str, str]:
    """``("module:qualname", sys.path root)`` of a module-level function, so that a fresh
    interpreter can import it.

    Raises:
        ValueError: ``fn`` is a lambda, a nested function, or defined in ``__main__``.
    """
    if not inspect.isfunction(fn):
        raise ValueError(
            f"run_distributed needs a module-level function, got {type(fn).__name__} {fn!r}; "
            "pass arguments through run_distributed(fn, *args) instead of functools.partial"
        )
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        raise ValueError(
            f"run_distributed needs a module-level function that a new process can import; "
            f"{qualname or fn!r} in module {module!r} is not (define it at the top of a module)"
        )
    source = inspect.getsourcefile(fn)
    root = Path(source).resolve().parent if source else Path.cwd()
    # A package module a.b.c lives two folders below the root that makes it importable.
    for _ in range(module.count(".")):
        root = root.parent
    return f"{module}:{qualname}", str(root)


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    nproc: int = 2,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    torchrun_args: Sequence[str] = (),
) -> list[Any]:
    """Call ``fn(*args)`` in ``nproc`` CPU processes under torchrun; return each rank's result.

    Each process has torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` set
    (a ``kwplug.Accelerator`` built in ``fn`` joins a gloo process group); the process group,
    if any, is destroyed after ``fn`` returns. The ranks start as :func:`run_torchrun` starts
    them: in well under a second, torch already imported, everything else imported afresh.

    Args:
        fn: a module-level function (importable by a new interpreter, e.g. defined in a test
            module); ``args`` and its return value must be picklable.
        nproc: number of processes (``--nproc-per-node``), default 2.
        timeout: seconds for the whole job, start-up included (default 120); the process tree
            is killed after it.
        env: extra environment variables for the job. Inside an active
            :class:`~kwplug.testing.PluginSandbox` (the ``kwplug_plugins`` fixture), the ranks
            see the sandbox's plugins (see :meth:`PluginSandbox.environment`).
        torchrun_args: extra torchrun options (they run the ``torchrun`` command line).

    Returns:
        ``fn``'s return values, indexed by rank.

    Raises:
        ValueError: ``fn`` cannot be imported by name (see :func:`importable_name`).
        DistributedRunError: a rank raised (its traceback is in the message), the job exited
            with an error, or it ran past ``timeout``.
    """
    target, root = importable_name(fn)
    with tempfile.TemporaryDirectory(prefix="kwplug-run-") as tmp:
        folder = Path(tmp)
        (folder / "call.pkl").write_bytes(pickle.dumps((target, args)))
        # Inside a PluginSandbox, the ranks see the sandbox's plugins, not the environment's.
        sandbox = active_environment()
        path = [root, sandbox.get("PYTHONPATH") or os.environ.get("PYTHONPATH", "")]
        child_env = {**sandbox, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
        result = run_torchrun(
            ["-m", "kwplug.testing._worker", str(folder)],
            nproc=nproc,
            timeout=timeout,
            env={**child_env, **(env or {})},
            torchrun_args=torchrun_args,
            folder=folder,
        )
        # The first traceback written is the cause; the others are usually its echo (peers
        # losing their connection to the rank that died).
        raised = sorted(folder.glob("rank_*.err"), key=lambda f: f.stat().st_mtime_ns)
        missing = [r for r in range(nproc) if not (folder / f"rank_{r}.pkl").is_file()]
        if result.returncode != 0 or raised or missing:
            headline = f"{target} failed in {nproc} processes (exit status {result.returncode})"
            if raised:
                summary = raised[0].with_suffix(".exc")
                what = summary.read_text() if summary.is_file() else "an exception"
                headline = f"{target}: {raised[0].stem.replace('_', ' ')} raised {what}"
            errors = [f"--- {f.stem.replace('_', ' ')} raised ---\n{f.read_text()}" for f in raised]
            raise DistributedRunError(
                f"{headline}\n(no result from rank(s) {missing})\n"
                + "\n".join(errors)
                + f"\n--- output ---\n{result.stdout[-4000:]}",
                returncode=result.returncode,
            )
        return [pickle.loads((folder / f"rank_{r}.pkl").read_bytes()) for r in range(nproc)]

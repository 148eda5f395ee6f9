"""Start test processes from a server that has already imported torch.

A fresh interpreter spends seconds importing torch before it runs a line of a test. Here the
ranks are started by torch's own elastic agent (``torch.distributed.launcher.api.elastic_launch``,
what ``torchrun`` runs, with its static rendezvous on a free 127.0.0.1 port) with
``start_method="forkserver"``: each rank is forked from Python's forkserver, which imported
torch once (``multiprocessing.set_forkserver_preload``, with the part of ``torch._dynamo``'s
imports that is safe to share, see :data:`_PRELOAD`); everything else is imported afresh.

Each rank is then made the process torchrun would have started: exactly the caller's
environment (plus torchrun's variables), a new interpreter's import path (``PYTHONPATH``
first), the job's ``sys.argv`` and working folder, multiprocessing's main process, exit
handlers run at the end, and the script's exit status. A job whose environment changes what
an interpreter reads only at start-up is not forked (:func:`forkable`).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import itertools
import json
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import threading
import traceback
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kwplug._process import forked_wait as _waiting

#: Imported once by the forkserver, so that no rank pays for it again. Nearly every rank builds
#: an optimizer, and torch imports ``torch._dynamo`` for the first one
#: (``Optimizer.add_param_group`` is wrapped by ``torch._disable_dynamo``): ~1.9 s on 2 cores.
#: Its part that touches neither ``torch.distributed`` nor ``torch._dynamo`` itself
#: (``torch.fx.experimental.symbolic_shapes`` and ``sympy``, ~0.6 s) is preloaded; a
#: 2-process parity run of Accelerate's ``nlp_example`` went from 6.3-7.2 s to 3.9-5.5 s
#: (A B A B, 7 runs each, load 2-3). Not ``torch._dynamo``: imported before the script's
#: ``init_process_group``, it made that run hang at exit one run in four (0 in 15 without): the
#: main thread, holding the GIL, frees DDP's reducer and joins gloo's worker, which waits for
#: the GIL to free a finished all-gather's tensor.
_PRELOAD = ["torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes"]

#: Prefixes of the variables the preloaded ``torch.fx.experimental._config`` reads at import: a
#: job that sets them differently is not forked. (Not ``TORCHINDUCTOR_``: torch sets
#: ``TORCHINDUCTOR_CACHE_DIR`` in the caller's environment itself once anything compiles.)
_STARTUP_PREFIXES = ("TORCHDYNAMO_", "TORCHEXPORT_")

#: What torch's elastic agent sets in a rank's environment (kept when the caller's is applied).
_AGENT_VARIABLES = frozenset(
    [
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    ]
)

#: Variables the interpreter reads only when it starts: a job whose value differs from the
#: server's cannot be forked faithfully (see :func:`forkable`). ``PYTHONPATH`` and
#: ``PYTHONDONTWRITEBYTECODE`` are applied to each job instead.
_STARTUP = tuple(
    [
        "PYTHONHASHSEED",
        "PYTHONWARNINGS",
        "PYTHONOPTIMIZE",
        "PYTHONDEVMODE",
        "PYTHONSAFEPATH",
        "PYTHONNOUSERSITE",
        "PYTHONUSERBASE",
        "PYTHONUTF8",
        "PYTHONIOENCODING",
        "PYTHONFAULTHANDLER",
        "PYTHONMALLOC",
        "PYTHONHOME",
        "PYTHONPLATLIBDIR",
        "PYTHONINSPECT",
        "PYTHONVERBOSE",
        "PYTHONNODEBUGRANGES",
        "PYTHONINTMAXSTRDIGITS",
        "PYTHONSTARTUP",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
    ]
)

#: torchrun's default ``--signals-to-handle``.
_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


class _ThreadWarning(logging.Filter):
    """Drops torch's warning that an agent off the main thread installs no signal handlers:
    that is the point here (the ranks are stopped by the timeout, not by signals)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "child thread" not in record.getMessage()


_FILTER = _ThreadWarning()
_server_lock = threading.Lock()
_server_env: dict[str, str] = {}
_baseline: list[str] = []

Mode = Literal["script", "module", "code"]


@dataclass(frozen=True)
class Job:
    """What each rank runs: ``python <script> *argv``, ``python -m <module> *argv`` or
    ``python -c <code> *argv``."""

    mode: Mode
    target: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str | None
    folder: str
    baseline: tuple[str, ...]


@dataclass(frozen=True)
class Finished:
    """A job's end: torchrun's exit status (0, or 1 when a rank failed), what the ranks wrote
    to stdout and to stderr (rank by rank; stderr ends with torchrun's summary of a failure),
    and whether it ran past its timeout."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def output(self) -> str:
        """stdout, then stderr."""
        return self.stdout + self.stderr


def _fresh_path() -> list[str]:
    """``sys.path`` of a new interpreter without ``PYTHONPATH``, less its first entry (the
    script's folder or the working folder, which depends on the job)."""
    with _server_lock:
        if not _baseline:
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            out = subprocess.run(
                [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                capture_output=True,
                text=True,
                check=True,
                env=env,
            ).stdout
            _baseline.extend(json.loads(out))
        return list(_baseline)


def _ensure_server() -> None:
    """Start the forkserver with torch imported and one thread per process (once)."""
    with _server_lock:
        multiprocessing.set_forkserver_preload(_PRELOAD)
        saved = dict(os.environ)
        try:
            # The server's environment is what libgomp reads when torch loads it.
            os.environ["OMP_NUM_THREADS"] = "1"
            if not _server_env:
                _server_env.update(os.environ)
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)


def forkable(env: Mapping[str, str]) -> bool:
    """Whether a job with environment ``env`` can be forked from the server: every variable
    the interpreter (or a preloaded module) reads only at start-up has the server's value
    (``OMP_NUM_THREADS=1``; the ``TORCHDYNAMO_*`` and ``TORCHEXPORT_*`` variables as the
    server had them)."""
    server = _server_env or {**os.environ, "OMP_NUM_THREADS": "1"}
    if not all(env.get(name) == server.get(name) for name in _STARTUP):
        return False
    return _prefixed(env) == _prefixed(server)


def _prefixed(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES)}


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # what the interpreter does with sys.exit("message")
    return 1


def _become_main_process() -> None:
    # The standard library has no public way to say it; these are the attributes through
    # which a process is multiprocessing's main one (name, no parent, children numbered
    # from 1 as "Process-1").
    current: Any = multiprocessing.current_process()
    current._identity, current._parent_pid, current._parent_name = (), None, None
    current.name = "MainProcess"
    process: Any = multiprocessing.process
    process._parent_process = None
    process._process_counter = itertools.count(1)


def _run_job(job: Job, keep: Mapping[str, str]) -> int:
    """Make this forked child the process ``job`` describes, run it, return its status."""
    os.setpgid(0, 0)  # its own process group, so a timeout stops what the job started too
    os.environ.clear()
    os.environ.update(job.env)
    os.environ.update(keep)
    if job.cwd:
        os.chdir(job.cwd)
    sys.dont_write_bytecode = bool(job.env.get("PYTHONDONTWRITEBYTECODE"))
    first = {
        "script": str(Path(job.target).resolve().parent),
        "module": os.getcwd(),
        "code": "",
    }[job.mode]
    extra = [p for p in job.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *job.baseline]
    importlib.invalidate_caches()
    sys.argv = ["-c" if job.mode == "code" else job.target, *job.argv]
    # Only this module of kwplug (and the package's lazy __init__) came with the entry point;
    # the job imports kwplug afresh, under its own environment and import path.
    for name in [m for m in sys.modules if m == "kwplug" or m.startswith("kwplug.")]:
        del sys.modules[name]
    # A new interpreter is multiprocessing's main process, with the platform's default start
    # method (a data loader's workers are started with it), not a forkserver child.
    multiprocessing.set_start_method(None, force=True)
    _become_main_process()
    # The server's exit handlers are not the job's; the job's run when it ends, as they would.
    atexit._clear()
    status = 0
    try:
        import torch

        with contextlib.suppress(ValueError, RuntimeError):
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        if job.mode == "script":
            runpy.run_path(job.target, run_name="__main__")
        elif job.mode == "module":
            runpy.run_module(job.target, run_name="__main__", alter_sys=True)
        else:
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(job.target, "<string>", "exec"), main.__dict__)
    except SystemExit as stop:
        status = _exit_status(stop.code)
    except BaseException:
        traceback.print_exc()  # as the interpreter prints an uncaught exception
        status = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    return status


def _rank_main(job: Job) -> None:
    """The entry point of every rank, in the forked child."""
    Path(job.folder, f"pid_{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
    agent = {k: v for k, v in os.environ.items() if k in _AGENT_VARIABLES}
    agent.update((k, v) for k, v in os.environ.items() if k.startswith("TORCHELASTIC_"))
    if status := _run_job(job, agent):
        # The agent reads a failed rank's status from the process; success returns normally
        # so that torch's wrapper hands the (empty) result back to the agent. The file tells
        # the launcher at once (see _wake_stopped).
        Path(job.folder, f"failed_{os.environ.get('RANK', '0')}").write_text(str(status))
        raise SystemExit(status)


def _single_main(job: Job) -> None:
    """The entry point of a single process (no torchrun variables), in the forked child."""
    Path(job.folder, "pid_0").write_text(str(os.getpid()))
    for fd, name in ((1, "stdout.log"), (2, "stderr.log")):
        with open(Path(job.folder, name), "ab") as log:
            os.dup2(log.fileno(), fd)
    if status := _run_job(job, {}):
        raise SystemExit(status)


def run_single(
    mode: Mode,
    target: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    timeout: float,
    folder: Path,
    cwd: str | None = None,
) -> Finished:
    """Run ``target`` as ``python <target> *argv`` would, in one process forked from the
    server; wait at most ``timeout`` seconds (then its process group is killed)."""
    _ensure_server()
    job = Job(mode, target, tuple(argv), dict(env), cwd, str(folder), tuple(_fresh_path()))
    process = multiprocessing.get_context("forkserver").Process(
        target=_single_main, args=(job,), name="kwplug-single"
    )
    process.start()
    timed_out = _waiting.wait(process, timeout, folder)
    returncode = process.exitcode if process.exitcode is not None else -9
    read = {
        name: (folder / name).read_text(errors="replace") if (folder / name).is_file() else ""
        for name in ("stdout.log", "stderr.log")
    }
    return Finished(returncode, read["stdout.log"], read["stderr.log"], timed_out)


def _outputs(logs: Path, nproc: int, name: str) -> str:
    parts = []
    for rank in range(nproc):
        for found in sorted(logs.glob(f"**/attempt_*/{rank}/{name}")):
            text = found.read_text(errors="replace")
            if text:
                parts.append(text if text.endswith("\n") else text + "\n")
    return "".join(parts)


def launch(
    mode: Mode,
    target: str,
    argv: Sequence[str],
    *,
    nproc: int,
    port: int,
    env: Mapping[str, str],
    timeout: float,
    folder: Path,
    cwd: str | None = None,
) -> Finished:
    """Run ``target`` in ``nproc`` ranks through torch's elastic agent; wait at most
    ``timeout`` seconds (then the ranks' process groups are killed)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _ensure_server()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_FILTER)
    # torchrun's command line tells its ranks which signals it forwards; the agent does not.
    env = {"TORCHELASTIC_SIGNALS_TO_HANDLE": _SIGNALS, **env}
    job = Job(mode, target, tuple(argv), env, cwd, str(folder), tuple(_fresh_path()))
    logs = folder / "logs"
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id="none",  # torchrun's run id and role with a static rendezvous
        role="default",
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"rank": 0},
        max_restarts=0,
        monitor_interval=0.05,
        start_method="forkserver",
        logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=Std.ALL),
    )
    outcome: dict[str, BaseException] = {}

    def agent() -> None:
        # Off the main thread, torch's agent installs no signal handlers in the caller.
        try:
            elastic_launch(config, _rank_main)(job)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=agent, name="kwplug-elastic-agent", daemon=True)
    thread.start()
    timed_out = _waiting.wait(thread, timeout, folder, poll=True)
    error = outcome.get("error")
    stdout, stderr = _outputs(logs, nproc, "stdout.log"), _outputs(logs, nproc, "stderr.log")
    if isinstance(error, ChildFailedError):
        stderr += str(error)  # torchrun prints the same summary of the failed ranks
    elif error is not None:
        stderr += "".join(traceback.format_exception(error))
    # As torchrun's own exit status: 1 whenever a rank failed, whatever its status was.
    returncode = 1 if error is not None or timed_out else 0
    return Finished(returncode, stdout, stderr, timed_out)

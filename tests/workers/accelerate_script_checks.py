"""Worker for tests/compat: run the checks of one (renamed) Accelerate test script, per rank.

Run under torchrun (2 processes, gloo). The script is imported as a module (its ``main`` is not
run on import), every module-level function that ``main`` calls as a statement is wrapped,
and ``main()`` runs: so the script itself decides which checks run, in which order and with
which arguments, as it does under ``accelerate launch``. Each check's outcome on this rank is
appended to ``<out>/rank<r>.jsonl`` as soon as it is known (one JSON object a line):

``{"check": id, "status": "pass" | "fail" | "error" | "timeout" | "aborted", "error": first
line, "where": file:line, "seconds": s}``; then ``<import>`` (the script did not import),
``<main>`` (the first error a statement of ``main`` raised outside a check, or ``pass``; each
statement of ``main`` is guarded, so the checks after a failed one still run) and ``<end>``
(whether ``accelerate`` was imported by this process).

A check that runs longer than ``--check-timeout`` seconds is recorded as ``timeout`` and the
process exits (torchrun then stops the other rank): a check that fails on one rank only leaves
the other waiting in a collective. After each check both ranks meet in torch's
``monitored_barrier`` (gloo), so a rank that failed early waits for the other instead of
running the next check's collectives against the previous check's; a barrier that times out
is recorded as ``aborted`` and ends the process. ``--skip`` names checks of an earlier run
(the harness re-runs a script after a timeout, skipping what already has a result).
"""

from __future__ import annotations

import argparse
import ast
import enum
import importlib.machinery
import importlib.util
import json
import os
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat"))


try:  # pytest.raises/pytest.fail signal a failed check with a BaseException
    from _pytest.outcomes import OutcomeException as _OUTCOME
except ImportError:  # pragma: no cover - pytest is in the test extra
    _OUTCOME = SystemExit  # type: ignore[misc,assignment]


class Recorder:
    """Appends this rank's results to its JSON-lines file, durably, one line per result."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        with self.lock, self.path.open("a") as stream:
            stream.write(json.dumps(record) + "\n")
            stream.flush()
            os.fsync(stream.fileno())


def describe(error: BaseException) -> tuple[str, str]:
    """(``Type: first line of the message``, ``file:line`` of the innermost frame)."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return text[:300], where


def _simple(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | float | str | enum.Enum):
        return True
    if isinstance(value, list | tuple):
        return all(_simple(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _simple(v) for k, v in value.items())
    return False


def _short(value: Any) -> str:
    if isinstance(value, enum.Enum):  # kwplug's and Accelerate's enums share member names
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


def label(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``name(args)`` with only plain values shown: objects (an Accelerator, a DataLoader)
    have library-specific types, so they are left out and repeated calls are numbered."""
    shown = [_short(a) for a in args if _simple(a)]
    shown += [f"{k}={_short(v)}" for k, v in kwargs.items() if _simple(v)]
    return f"{name}({', '.join(shown)})" if shown else name


def called_checks(source: str) -> list[str]:
    """Module-level functions that ``main`` calls as a statement (their result unused), in
    source order; a call whose result ``main`` keeps (``accelerator = create_accelerator()``)
    is set-up, not a check."""
    tree = ast.parse(source)
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    names: list[str] = []
    for node in ast.walk(main):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Name) and func.id in defined and func.id not in names:
                names.append(func.id)
    return names


def guard_main(tree: ast.Module) -> ast.Module:
    """``tree`` with each top-level statement of ``main`` inside ``try``: a statement that
    raises between checks (``accelerator.state.distributed_type = ...`` on a frozen state) is
    reported to ``_compat_main_failed`` and the next statement runs, so the checks after it
    still get a result (one that needed the failed statement fails on its own)."""
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    guarded: list[ast.stmt] = []
    for statement in main.body:
        report = ast.Expr(
            ast.Call(
                ast.Name("_compat_main_failed", ast.Load()),
                [ast.Name("_compat_error", ast.Load())],
                [],
            )
        )
        handler = ast.ExceptHandler(ast.Name("Exception", ast.Load()), "_compat_error", [report])
        guarded.append(ast.copy_location(ast.Try([statement], [handler], [], []), statement))
    main.body = guarded
    return ast.fix_missing_locations(tree)


def _in_step(timeout: float) -> str | None:
    """Wait for every rank (torch's monitored barrier); the error's first line if one did not
    arrive in time. Nothing to wait for without a process group (the script destroyed it)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=True)
        else:
            dist.barrier()
    except Exception as error:  # a rank is gone or stuck in the previous check
        return describe(error)[0]
    return None


class Checks:
    """Wraps the checks of one module; runs each with a watchdog, records its outcome."""

    def __init__(self, recorder: Recorder, skip: set[str], timeout: float) -> None:
        self.recorder = recorder
        self.skip = skip
        self.timeout = timeout
        self.seen: dict[str, int] = {}
        self.depth = 0  # a check calling another wrapped function is one check

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def check(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return function(*args, **kwargs)
            base = label(name, args, kwargs)
            self.seen[base] = self.seen.get(base, 0) + 1
            check_id = base if self.seen[base] == 1 else f"{base}#{self.seen[base]}"
            if check_id in self.skip:
                return None
            return self.run(check_id, function, args, kwargs)

        return check

    def run(self, check_id: str, function: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        def expire() -> None:
            self.recorder.write(
                {
                    "check": check_id,
                    "status": "timeout",
                    "error": f"no result after {self.timeout:.0f} s (waiting in a collective?)",
                }
            )
            os._exit(3)

        watchdog = threading.Timer(self.timeout, expire)
        watchdog.daemon = True
        start = time.monotonic()
        watchdog.start()
        record: dict[str, Any] = {"check": check_id, "status": "pass", "error": "", "where": ""}
        result = None
        self.depth += 1
        try:
            result = function(*args, **kwargs)
        except (Exception, SystemExit, _OUTCOME) as error:  # pytest.fail is a BaseException
            record["status"] = "fail" if isinstance(error, AssertionError) else "error"
            record["error"], record["where"] = describe(error)
        finally:
            self.depth -= 1
            watchdog.cancel()
        record["seconds"] = round(time.monotonic() - start, 2)
        self.recorder.write(record)
        stuck = _in_step(self.timeout + 10)
        if stuck is not None:
            self.recorder.write({"check": check_id, "status": "aborted", "error": stuck})
            os._exit(4)
        return result


def stand_in(name: str) -> types.ModuleType:
    """A module for a third-party package that is not installed (``datasets``...): attribute
    lookups succeed so that the script imports, anything called raises ModuleNotFoundError,
    except ``utils.logging.set_verbosity_*`` (the verbosity of a package that is not there)."""

    class Missing:
        def __init__(self, path: str) -> None:
            self._path = path

        def __getattr__(self, attr: str) -> Any:
            if attr.startswith("__"):  # probes such as __file__ see no such attribute
                raise AttributeError(attr)
            return Missing(f"{self._path}.{attr}")

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if self._path.rsplit(".", 1)[-1].startswith("set_verbosity"):
                return None
            raise ModuleNotFoundError(f"{self._path}: {name} is not installed")

    def lookup(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{name}.{attr}")

    module = types.ModuleType(name)
    # find_spec() answers from this spec; the missing distribution metadata then makes
    # accelerate's is_<name>_available() say False, as without the stand-in
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__getattr__ = lookup  # type: ignore[method-assign]
    return module


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--script", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip", type=Path)
    parser.add_argument("--check-timeout", type=float, default=45.0)
    parser.add_argument("--stand-in", default="", help="comma-separated modules, if missing")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    recorder = Recorder(args.out / f"rank{rank}.jsonl")
    skip = set(json.loads(args.skip.read_text())) if args.skip else set()
    for name in filter(None, args.stand_in.split(",")):
        if importlib.util.find_spec(name) is None:
            sys.modules[name] = stand_in(name)

    source = args.script.read_text()
    sys.path.insert(0, str(args.script.parent))
    sys.argv = [str(args.script)]
    module_name = f"compat_{args.script.stem}"
    checks = Checks(recorder, skip, args.check_timeout)
    try:
        spec = importlib.util.spec_from_file_location(module_name, args.script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # pickle finds the script's classes by module name
        module.__file__ = str(args.script)
        failures: list[BaseException] = []
        module.__dict__["_compat_main_failed"] = failures.append
        code = compile(guard_main(ast.parse(source)), str(args.script), "exec")
        exec(code, module.__dict__)
    except Exception as error:
        text, where = describe(error)
        recorder.write({"check": "<import>", "status": "error", "error": text, "where": where})
    else:
        for name in called_checks(source):
            setattr(module, name, checks.wrap(name, getattr(module, name)))
        record = {"check": "<main>", "status": "pass", "error": "", "where": ""}
        try:
            module.main()
        except (Exception, SystemExit, _OUTCOME) as error:
            failures.insert(0, error)
        if failures:
            record["status"] = "error"
            record["error"], record["where"] = describe(failures[0])
            if len(failures) > 1:
                record["error"] += f" (and {len(failures) - 1} more statements of main)"
        recorder.write(record)
    recorder.write({"check": "<end>", "accelerate_imported": "accelerate" in sys.modules})
    return 0


if __name__ == "__main__":
    sys.exit(main())

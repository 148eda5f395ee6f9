"""Import time and Accelerator construction: kwplug vs Accelerate.

- ``import kwplug`` / ``import accelerate`` with torch already imported, each in a fresh
  interpreter (processes interleaved), followed in the same interpreter by the *first*
  ``Accelerator(cpu=True, kwargs_handlers=[5 handlers])`` -- handler classes imported and
  instantiated, entry-point discovery included.
- Repeated construction of the same Accelerator (5 handlers) in one process, interleaved.
- ``end_training()`` on one ``Accelerator(cpu=True)`` without a process group, in one process.
- The ``kwplug plugins`` command (``python -m kwplug plugins``, a whole process, wall clock)
  against ``python -c "import torch"`` (the raw column: the floor every kwplug command pays).

There is nothing to import or construct in raw PyTorch, so the raw column is empty; the
targets are absolute.

Run: ``python -m benchmarks.construct_import [--quick] [--json PATH]``.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks._common import (
    CLOCK_ENV,
    Result,
    Samples,
    Target,
    block,
    child_env,
    interleave,
    run_main,
    timing_row,
)

DESCRIPTION = "Import time (torch loaded) and Accelerator(5 handlers) construction."

HANDLERS = (
    "AutocastKwargs",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "ProfileKwargs",
)

# Runs in a fresh interpreter and prints its timings as JSON (first_s = handlers_s + accelerator_s:
# importing and instantiating the 5 handler classes, then the Accelerator with discovery).
CHILD = """
import json, os, time, warnings
warnings.simplefilter("ignore")
now = {{"cpu": time.process_time, "thread": time.thread_time}}.get(
    os.environ.get("{clock_env}", ""), time.perf_counter
)
t0 = now()
import torch
t1 = now()
import {module}
t2 = now()
from {module} import Accelerator, {handlers}
handlers = [{calls}]
t3 = now()
accelerator = Accelerator(cpu=True, kwargs_handlers=handlers)
t4 = now()
print(json.dumps({{
    "torch_s": t1 - t0,
    "import_s": t2 - t1,
    "first_s": t4 - t2,
    "handlers_s": t3 - t2,
    "accelerator_s": t4 - t3,
}}))
"""


def child_source(module: str) -> str:
    """The child's program for ``module`` (``kwplug`` or ``accelerate``)."""
    return CHILD.format(
        clock_env=CLOCK_ENV,
        module=module,
        handlers=", ".join(HANDLERS),
        calls=", ".join(f"{name}()" for name in HANDLERS),
    )


def fresh_process(module: str) -> dict[str, float]:
    """Run the child program for ``module`` in a new interpreter; its timings.

    Bytecode caching is on in the child (``PYTHONDONTWRITEBYTECODE`` removed), as in an
    installed package; the first child of each framework is a discarded warm-up that writes the
    caches of an editable checkout (except with ``--quick``, a smoke test).
    """
    env = child_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    out = subprocess.run(
        [sys.executable, "-c", child_source(module)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{module} child failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def cli_process(args: Sequence[str]) -> float:
    """Wall seconds of ``python *args`` in a fresh process (output discarded).

    Raises:
        RuntimeError: the process failed.
    """
    env = child_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    elapsed = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{out.stderr[-4000:]}")
    return elapsed


def make_constructor(impl: str) -> Callable[[int], None]:
    """``n`` constructions of ``impl``'s Accelerator with 5 handlers."""
    if impl == "kwplug":
        import kwplug as module
    else:
        import accelerate as module

    classes = [getattr(module, name) for name in HANDLERS]
    accelerator_cls = module.Accelerator

    def construct(n: int) -> None:
        for _ in range(n):
            accelerator_cls(cpu=True, kwargs_handlers=[cls() for cls in classes])

    construct(1)
    return construct


def make_end_training(impl: str) -> Callable[[int], None]:
    """``n`` calls of ``end_training()`` on one ``Accelerator(cpu=True)`` of ``impl`` (one
    process, no process group, no trackers)."""
    if impl == "kwplug":
        import kwplug as module
    else:
        import accelerate as module

    accelerator = module.Accelerator(cpu=True)

    def end(n: int) -> None:
        for _ in range(n):
            accelerator.end_training()

    end(1)
    return end


def run(quick: bool, with_accelerate: bool) -> Result:
    """Measure import, first and repeated construction; see the module docstring."""
    frameworks = ["kwplug"] + (["accelerate"] if with_accelerate else [])
    result = Result("construct_import", quick)

    reps = 1 if quick else 11
    children: dict[str, list[dict[str, float]]] = {impl: [] for impl in frameworks}

    def child_block(impl: str) -> float:
        children[impl].append(fresh_process(impl))
        return children[impl][-1]["import_s"]

    # The warm-up repetition's children are dropped below. --quick (a smoke test: timings are
    # not read) has none: two fresh interpreters importing torch saved (~10 s of CPU).
    warmup = 0 if quick else 1
    interleave({impl: functools.partial(child_block, impl) for impl in frameworks}, reps, warmup)
    children = {impl: runs[warmup:] for impl, runs in children.items()}
    imports: Samples = {impl: [c["import_s"] for c in children[impl]] for impl in frameworks}
    firsts: Samples = {impl: [c["first_s"] for c in children[impl]] for impl in frameworks}
    result.rows.append(timing_row("import (torch already imported)", imports, unit="ms", scale=1e3))
    result.rows.append(
        timing_row(
            "first Accelerator(5 handlers)",
            firsts,
            unit="ms",
            scale=1e3,
            note="fresh process: handler imports, plugin discovery and construction",
        )
    )

    totals: Samples = {
        impl: [c["import_s"] + c["first_s"] for c in children[impl]] for impl in frameworks
    }
    result.rows.append(
        timing_row("import + first Accelerator(5 handlers)", totals, unit="ms", scale=1e3)
    )

    n = 5 if quick else 20
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        constructors = {impl: make_constructor(impl) for impl in frameworks}
        blocks = {impl: block(fn, n) for impl, fn in constructors.items()}
        repeated = interleave(blocks, reps=3 if quick else 31, warmup=1)
    result.rows.append(timing_row("repeated Accelerator(5 handlers)", repeated))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enders = {impl: block(make_end_training(impl), n) for impl in frameworks}
        ends = interleave(enders, reps=3 if quick else 31, warmup=1)
    result.rows.append(
        timing_row("end_training() (one process, no group)", ends, note="issue 20: <= 1 ms")
    )

    cli_blocks = {
        "raw": functools.partial(cli_process, ["-c", "import torch"]),
        "kwplug": functools.partial(cli_process, ["-m", "kwplug", "plugins"]),
    }
    cli = interleave(cli_blocks, reps=1 if quick else 7, warmup=0 if quick else 1)
    result.rows.append(
        timing_row(
            "kwplug plugins (process) vs python -c 'import torch'",
            cli,
            unit="ms",
            scale=1e3,
            note="raw: the interpreter importing torch; kwplug extra: the command's own cost",
        )
    )

    import_row, first_row, _total_row, repeated_row, end_row, cli_row = result.rows
    result.targets = [
        Target("import kwplug (torch loaded)", _num(import_row.kwplug), "<=", 20, "ms"),
        Target("first Accelerator(5 handlers)", _num(first_row.kwplug), "<=", 3, "ms"),
        Target("repeated Accelerator(5 handlers)", _num(repeated_row.kwplug), "<=", 50, "µs"),
        Target("end_training() without a group", _num(end_row.kwplug), "<=", 1000, "µs"),
        Target("kwplug plugins over import torch", cli_row.kwplug_extra, "<=", 500, "ms"),
    ]
    if isinstance(first_row.accelerate, float):  # issue 13: first Accelerator <= Accelerate's
        result.targets.append(
            Target(
                "first Accelerator: kwplug vs Accelerate",
                _num(first_row.kwplug),
                "<=",
                first_row.accelerate,
                "ms",
            )
        )
    torch_s: dict[str, Any] = {impl: [c["torch_s"] for c in children[impl]] for impl in frameworks}
    result.info = {
        "children": children,
        "import_torch_s": torch_s,
        "constructions_per_block": n,
        "samples_s_per_construction": repeated,
    }
    return result


def _num(value: float | str | None) -> float | None:
    return value if isinstance(value, float) else None


def main(argv: Sequence[str] | None = None) -> Result:
    """``python -m benchmarks.construct_import``."""
    return run_main("construct_import", DESCRIPTION, run, argv)


if __name__ == "__main__":
    main()

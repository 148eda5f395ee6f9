"""Instructions per training step under callgrind: raw PyTorch, kwplug and Accelerate.

A few microseconds per step cannot be timed reliably on a shared machine; the number of
instructions the CPU executes for a step can: valgrind's callgrind counts them, whatever the
load. The worker builds the loops of :mod:`benchmarks.step_overhead` (``Linear(16, 16)``,
batch 8, SGD, a ``LambdaLR``), warms them, gives every scheduler the same large step count
(Python ints above 256 are allocated, so unequal counts would cost unequal work), and turns
callgrind's instrumentation on only around each measured block of ``--steps`` steps (client
requests from a small C helper compiled at run time). Import and set-up are not counted.

Blocks (each its own copy of the model, optimizer and scheduler, except ``kwplug``, which
trains ``prepared_all``'s):

- ``raw``, ``raw_copy``: the raw loop twice (the second is the A/A control);
- ``prepared_model``, ``prepared_optimizer``, ``prepared_scheduler``, ``prepared_all``: the
  raw loop's code on kwplug's prepared model, optimizer, scheduler or all three (the
  wrappers' own cost);
- ``kwplug``: the Accelerator loop (``accelerator.autocast()``, ``accelerator.backward``) on
  ``prepared_all``'s objects;
- ``accelerate``: the same loop on Hugging Face Accelerate (when it is installed).

Needs ``valgrind`` (with ``valgrind/callgrind.h``) and a C compiler (``cc``); without them it
says what is missing and exits 0. A run takes about 2-3 minutes per precision.

Run: ``python -m benchmarks instructions [--steps 200] [--precision fp32,bf16] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks._common import accelerate_available, child_env, meta, write_json

_HELPER_SOURCE = """
#include <valgrind/callgrind.h>
void kw_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void kw_stop(const char *name) { CALLGRIND_DUMP_STATS_AT(name); CALLGRIND_STOP_INSTRUMENTATION; }
"""

BLOCKS: tuple[str, ...] = (
    "raw",
    "prepared_model",
    "prepared_optimizer",
    "prepared_scheduler",
    "prepared_all",
    "kwplug",
    "raw_copy",
    "accelerate",
)


def missing_tools() -> str | None:
    """What this benchmark needs and the machine lacks, or ``None``."""
    for tool in ("valgrind", "cc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = subprocess.run(
        ["cc", "-E", "-x", "c", "-"],
        input="#include <valgrind/callgrind.h>\n",
        capture_output=True,
        text=True,
        check=False,
    )
    return None if probe.returncode == 0 else "valgrind's header valgrind/callgrind.h is missing"


def build_helper(folder: str) -> str:
    """Compile the client-request helper into ``folder``; its path."""
    source, library = os.path.join(folder, "helper.c"), os.path.join(folder, "helper.so")
    with open(source, "w", encoding="utf-8") as handle:
        handle.write(_HELPER_SOURCE)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", library, source], check=True)
    return library


def parse_dumps(folder: str, steps: int) -> dict[str, float]:
    """Instructions per step of each block, from the callgrind dumps in ``folder``."""
    counts: dict[str, float] = {}
    for name in os.listdir(folder):
        if not name.startswith("callgrind.out."):
            continue
        with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as handle:
            text = handle.read()
        block = re.search(r"^desc: Trigger: Client Request: (\S+)$", text, re.MULTILINE)
        total = re.search(r"^totals: (\d+)", text, re.MULTILINE)
        if block and total:
            counts[block.group(1)] = int(total.group(1)) / steps
    return counts


# -- the worker (runs under valgrind) -----------------------------------------------------------


def _blocks(precision: str, steps: int, with_accelerate: bool) -> dict[str, Callable[[], None]]:
    """One callable per block, each running ``steps`` steps on objects of its own."""
    import itertools

    import kwplug
    from benchmarks import step_overhead as so

    batches, loss_fn = so.make_batches("tiny")
    data = list(itertools.islice(itertools.cycle(batches), steps))
    raw_loop = so.raw_loop_fp32 if precision == "fp32" else so.raw_loop_bf16
    mixed = "no" if precision == "fp32" else precision
    schedulers: list[Any] = []

    def objects() -> tuple[Any, Any, Any]:
        model = so.make_model("tiny")
        optimizer = so.make_optimizer(model)
        scheduler = so.make_scheduler(optimizer)
        schedulers.append(scheduler)
        return model, optimizer, scheduler

    def accelerator() -> Any:
        return kwplug.Accelerator(cpu=True, mixed_precision=mixed)

    blocks: dict[str, Callable[[], None]] = {}
    for name in ("raw", "raw_copy"):
        m, o, s = objects()
        blocks[name] = lambda m=m, o=o, s=s: raw_loop(m, o, data, loss_fn, s)
    # The raw loop's code on one prepared object at a time (the wrappers' own cost): the
    # model alone (its forward wrapper under mixed precision), the optimizer alone (the raw
    # scheduler steps the optimizer it wraps), the scheduler (over a prepared optimizer).
    m1, o1, s1 = objects()
    pm1 = accelerator().prepare(m1)
    blocks["prepared_model"] = lambda: raw_loop(pm1, o1, data, loss_fn, s1)
    m2, o2, s2 = objects()
    po2 = accelerator().prepare(o2)
    blocks["prepared_optimizer"] = lambda: raw_loop(m2, po2, data, loss_fn, s2)
    m3, o3, s3 = objects()
    _, ps3 = accelerator().prepare(o3, s3)
    blocks["prepared_scheduler"] = lambda: raw_loop(m3, o3, data, loss_fn, ps3)
    m4, o4, s4 = objects()
    acc4 = accelerator()
    pm4, po4, ps4 = acc4.prepare(m4, o4, s4)
    blocks["prepared_all"] = lambda: raw_loop(pm4, po4, data, loss_fn, ps4)
    blocks["kwplug"] = lambda: so.framework_loop(acc4, pm4, po4, data, loss_fn, ps4)
    if with_accelerate:
        model, optimizer, scheduler = objects()
        other = so.make_accelerator("accelerate", precision)
        m5, po5, ps5 = other.prepare(model, optimizer, scheduler)
        blocks["accelerate"] = lambda: so.framework_loop(other, m5, po5, data, loss_fn, ps5)
    for run in blocks.values():  # warm: lazy set-up, first-step work, specialised bytecode
        for _ in range(3):
            run()
    for scheduler in schedulers:
        scheduler._step_count, scheduler.last_epoch = 100_000, 99_999
    return blocks


def worker(args: argparse.Namespace) -> None:
    """Run every block once between the helper's start and stop requests."""
    import torch

    torch.set_num_threads(1)
    helper = ctypes.CDLL(args.helper)
    blocks = _blocks(args.precision, args.steps, not args.no_accelerate)
    gc.collect()
    gc.disable()  # no collection inside a counted block
    for name in BLOCKS:
        if name in blocks:
            helper.kw_start()
            blocks[name]()
            helper.kw_stop(name.encode())


# -- the parent ---------------------------------------------------------------------------------


def measure(
    precision: str, steps: int, helper: str, folder: str, accelerate: bool
) -> dict[str, float]:
    """Instructions per step of every block for ``precision`` (one valgrind run)."""
    out = os.path.join(folder, precision)
    os.makedirs(out)
    cmd = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no",
        f"--callgrind-out-file={os.path.join(out, 'callgrind.out.%p')}",
        sys.executable, "-m", "benchmarks.step_instructions", "--worker",
        "--precision", precision, "--steps", str(steps), "--helper", helper,
    ]  # fmt: skip
    cmd += [] if accelerate else ["--no-accelerate"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(cmd, cwd=root, env=child_env(), check=True, stderr=subprocess.DEVNULL)
    return parse_dumps(out, steps)


def table(counts: dict[str, float], precision: str) -> list[str]:
    """Markdown rows: instructions per step and the difference to ``raw``."""
    raw = counts["raw"]
    lines = [
        f"| block ({precision}) | instructions/step | over raw | ratio |",
        "|---|---|---|---|",
    ]
    for name in BLOCKS:
        if name in counts:
            value = counts[name]
            lines.append(f"| {name} | {value:,.0f} | {value - raw:+,.0f} | {value / raw:.3f}x |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=200, help="steps per block (default 200)")
    parser.add_argument("--precision", default="fp32,bf16", help="fp32, bf16 or both")
    parser.add_argument("--json", default=None, help="write the counts here")
    parser.add_argument("--no-accelerate", action="store_true", help="leave Accelerate out")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--helper", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.worker:
        worker(args)
        return 0
    precisions = [p for p in args.precision.split(",") if p]
    if not precisions or set(precisions) - {"fp32", "bf16"}:
        parser.error(f"--precision takes fp32, bf16 or fp32,bf16, got {args.precision!r}")
    missing = missing_tools()
    if missing is not None:
        print(f"step_instructions: skipped, {missing}")
        return 0
    accelerate = accelerate_available() and not args.no_accelerate
    results: dict[str, Any] = {"meta": meta(), "steps": args.steps, "counts": {}}
    with tempfile.TemporaryDirectory(prefix="kwplug-instructions-") as folder:
        helper = build_helper(folder)
        for precision in precisions:
            counts = measure(precision, args.steps, helper, folder, accelerate)
            results["counts"][precision] = counts
            print("\n".join(table(counts, precision)) + "\n", flush=True)
    write_json(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

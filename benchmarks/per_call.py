"""Cost of one call of the training loop's per-batch helpers: ``accumulate`` and
``gather_for_metrics``, kwplug against Accelerate (one process, CPU).

- accumulate, steps=1 / steps=4: ``with accelerator.accumulate(model): pass`` with a prepared
  ``Linear(16, 16)`` and ``gradient_accumulation_steps`` 1 or 4 (Accelerate and kwplug count
  the step and pick ``no_sync`` or not on every entry). Raw is what a hand-written loop does:
  a step counter and a ``contextlib.nullcontext()`` block (one process has nothing to sync).
- gather_for_metrics: ``accelerator.gather_for_metrics(t)`` of a 32-element float32 tensor
  outside a prepared loader (one process: the input comes back). Raw is a Python function
  that returns its argument: the whole figure is the library's overhead.

The goals: each within 1.5x of Accelerate's time per call, or better (issue 20, goal 1);
``accumulate`` with 4 micro-batches at most Accelerate's time (issue 31, goal 2: the
non-synchronising micro-batches make no hook call and record nothing).

Run: ``python -m benchmarks.per_call [--quick] [--json PATH]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks._common import (
    Result,
    Target,
    block,
    interleave,
    make_accelerator,
    median,
    run_main,
    timing_row,
)

DESCRIPTION = "µs per `accumulate` block and per `gather_for_metrics` call, vs Accelerate."
#: kwplug's time per call may be at most this multiple of Accelerate's.
GOAL_VS_ACCELERATE = 1.5
#: ... and for these cases at most this one (issue 31, goal 2).
GOALS_VS_ACCELERATE = {"accumulate, steps=4": 1.0}
_METRIC = torch.ones(32)


def raw_accumulate(steps: int) -> Callable[[int], None]:
    """``n`` blocks of a hand-written loop's accumulation bookkeeping."""
    count = [0]

    def run(n: int) -> None:
        for _ in range(n):
            count[0] += 1
            _sync = count[0] % steps == 0  # what the loop would test
            with contextlib.nullcontext():
                pass

    return run


def via_accumulate(accelerator: Any) -> Callable[[int], None]:
    """``n`` ``with accelerator.accumulate(model): pass`` blocks."""
    model = accelerator.prepare(torch.nn.Linear(16, 16))

    def run(n: int) -> None:
        for _ in range(n):
            with accelerator.accumulate(model):
                pass

    return run


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def raw_gather(n: int) -> None:
    """``n`` calls of a function returning its argument."""
    for _ in range(n):
        _identity(_METRIC)


def via_gather(accelerator: Any) -> Callable[[int], None]:
    """``n`` ``accelerator.gather_for_metrics(t)`` calls."""

    def run(n: int) -> None:
        for _ in range(n):
            accelerator.gather_for_metrics(_METRIC)

    return run


def run(quick: bool, with_accelerate: bool) -> Result:
    """Measure every case; see the module docstring."""
    frameworks = ["kwplug"] + (["accelerate"] if with_accelerate else [])
    reps, n = (3, 500) if quick else (41, 3_000)
    result = Result("per_call", quick)
    cases: list[tuple[str, Callable[[int], None], Callable[[Any], Callable[[int], None]], int]]
    cases = [
        ("accumulate, steps=1", raw_accumulate(1), via_accumulate, 1),
        ("accumulate, steps=4", raw_accumulate(4), via_accumulate, 4),
        ("gather_for_metrics, 1 process", raw_gather, via_gather, 1),
    ]
    samples_by_case = {}
    for case, raw, via, steps in cases:
        goal = GOALS_VS_ACCELERATE.get(case, GOAL_VS_ACCELERATE)
        fns: dict[str, Callable[[int], None]] = {"raw": raw}
        for impl in frameworks:
            fns[impl] = via(make_accelerator(impl, gradient_accumulation_steps=steps))
        samples = interleave({i: block(f, n) for i, f in fns.items()}, reps=reps, warmup=1)
        samples_by_case[case] = samples
        result.rows.append(timing_row(case, samples))
        if with_accelerate:
            ratios = [k / a for k, a in zip(samples["kwplug"], samples["accelerate"], strict=True)]
            ratio = median(ratios)
            result.checks[f"{case}: kwplug / accelerate"] = ratio
            result.targets.append(
                Target(f"{case}: kwplug time / Accelerate's", ratio, "<=", goal, "x")
            )
        else:  # the goal is relative to Accelerate: not measurable without it
            result.targets.append(
                Target(f"{case}: kwplug time / Accelerate's", None, "<=", goal, "x")
            )
    result.info = {"reps": reps, "calls_per_block": n, "samples_s_per_call": samples_by_case}
    return result


def main(argv: Sequence[str] | None = None) -> Result:
    """``python -m benchmarks.per_call``."""
    return run_main("per_call", DESCRIPTION, run, argv)


if __name__ == "__main__":
    main()

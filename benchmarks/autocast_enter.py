"""Cost of one ``with accelerator.autocast(): pass`` against the raw context manager.

- bf16: ``with torch.autocast("cpu", dtype=torch.bfloat16): pass`` (raw) vs
  ``with accelerator.autocast(): pass`` of a ``mixed_precision="bf16"`` Accelerator.
- off: ``with contextlib.nullcontext(): pass`` (raw: the cheapest no-op context) vs the same
  with ``mixed_precision="no"``.
- forward, bf16: ``with torch.autocast("cpu", dtype=torch.bfloat16): module(x)`` (raw) vs
  ``prepared(x)``, the forward that ``prepare()`` runs under autocast with float32 outputs (as
  Accelerate's). The module returns its float32 input, so the figure is the wrapper's cost,
  not a tensor conversion.

Each figure is the time of a whole ``with`` statement (create, enter, exit), loop included
(the bare loop's cost is recorded in ``info``; it is a few ns).

Run: ``python -m benchmarks.autocast_enter [--quick] [--json PATH]``.
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
    run_main,
    timed,
    timing_row,
)

DESCRIPTION = "Cost of one `with accelerator.autocast():` against torch.autocast / nullcontext."


def raw_bf16(n: int) -> None:
    """``n`` raw bf16 autocast regions."""
    for _ in range(n):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pass


def raw_off(n: int) -> None:
    """``n`` no-op context regions."""
    for _ in range(n):
        with contextlib.nullcontext():
            pass


def via(accelerator: Any) -> Callable[[int], None]:
    """``n`` regions of ``accelerator.autocast()``, written as users write them."""

    def enter(n: int) -> None:
        for _ in range(n):
            with accelerator.autocast():
                pass

    return enter


class _Passthrough(torch.nn.Module):
    """A module whose forward costs nothing but the call: it returns its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


_INPUT = torch.ones(2, 2)


def raw_forward(n: int) -> None:
    """``n`` calls of a bare module inside a bare bf16 autocast region each."""
    module = _Passthrough()
    for _ in range(n):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            module(_INPUT)


def prepared_forward(accelerator: Any) -> Callable[[int], None]:
    """``n`` calls of a module prepared by a ``mixed_precision="bf16"`` ``accelerator``."""
    module = accelerator.prepare(_Passthrough())

    def call(n: int) -> None:
        for _ in range(n):
            module(_INPUT)

    return call


def empty(n: int) -> None:
    """The bare loop."""
    for _ in range(n):
        pass


def run(quick: bool, with_accelerate: bool) -> Result:
    """Measure bf16 and off; see the module docstring."""
    frameworks = ["kwplug"] + (["accelerate"] if with_accelerate else [])
    reps = 3 if quick else 61
    n = 2_000 if quick else 5_000
    result = Result("autocast_enter", quick)
    samples_by_case = {}
    for case, mixed, raw in (("bf16", "bf16", raw_bf16), ("off", "no", raw_off)):
        fns: dict[str, Callable[[int], None]] = {"raw": raw}
        for impl in frameworks:
            fns[impl] = via(make_accelerator(impl, mixed_precision=mixed))
        blocks = {impl: block(fn, n) for impl, fn in fns.items()}
        samples = interleave(blocks, reps=reps, warmup=1)
        samples_by_case[case] = samples
        baseline = "torch.autocast" if case == "bf16" else "contextlib.nullcontext()"
        result.rows.append(timing_row(f"autocast entry, {case}", samples, note=f"raw = {baseline}"))
    forward_fns: dict[str, Callable[[int], None]] = {"raw": raw_forward}
    for impl in frameworks:
        forward_fns[impl] = prepared_forward(make_accelerator(impl, mixed_precision="bf16"))
    samples = interleave({i: block(f, n) for i, f in forward_fns.items()}, reps=reps, warmup=1)
    samples_by_case["forward"] = samples
    result.rows.append(
        timing_row("prepared forward, bf16", samples, note="raw = module(x) in torch.autocast")
    )
    result.info = {
        "reps": reps,
        "entries_per_block": n,
        "bare_loop_us_per_iteration": timed(empty, n * 10) * 1e6,
        "samples_s_per_entry": samples_by_case,
    }
    bf16, off, forward = result.rows
    # The absolute goals (3.2 / 0.4 µs) were set where raw torch.autocast costs 3.0 µs and
    # nullcontext 0.25 µs; the same goals relative to raw (+0.2 / +0.15 µs) hold on any machine.
    result.targets = [
        Target("accelerator.autocast() entry, bf16", _num(bf16.kwplug), "<=", 3.2, "µs"),
        Target("accelerator.autocast() entry, off", _num(off.kwplug), "<=", 0.4, "µs"),
        Target(
            "autocast entry bf16, extra over torch.autocast", bf16.kwplug_extra, "<=", 0.2, "µs"
        ),
        Target("autocast entry off, extra over nullcontext()", off.kwplug_extra, "<=", 0.15, "µs"),
        # Issue 20: the mixed-precision forward wrapper over a bare torch.autocast region.
        Target(
            "prepared forward bf16, extra over torch.autocast",
            forward.kwplug_extra,
            "<=",
            2.0,
            "µs",
        ),
    ]
    return result


def _num(value: float | str | None) -> float | None:
    return value if isinstance(value, float) else None


def main(argv: Sequence[str] | None = None) -> Result:
    """``python -m benchmarks.autocast_enter``."""
    return run_main("autocast_enter", DESCRIPTION, run, argv)


if __name__ == "__main__":
    main()

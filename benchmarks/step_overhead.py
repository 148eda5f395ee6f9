"""Training-step overhead: raw PyTorch vs kwplug vs Accelerate, same loop, same data.

Workloads: ``tiny`` (``Linear(16, 16)``, batch 8, MSE) and ``mlp`` (512-512-10 with ReLU, batch
64, cross-entropy), each in fp32 and in bf16 autocast, SGD. The framework loop is the one users
write::

    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    for x, y in batches:
        with accelerator.autocast():
            loss = loss_fn(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

(the scheduler is a ``LambdaLR`` changing the learning rate every step) and the raw loop is
the same without the Accelerator (``torch.autocast("cpu", dtype=torch.bfloat16)`` in bf16, no
context at all in fp32). Each implementation trains its own copy of the same initial model on
the same batch sequence, blocks interleaved; afterwards kwplug's parameters must equal the raw
loop's exactly (asserted).

Run: ``python -m benchmarks.step_overhead [--quick] [--json PATH]``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks._common import Result, Samples, Target, block, interleave, run_main, timing_row

DESCRIPTION = "Training-step overhead: raw PyTorch vs kwplug vs Accelerate."

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

WORKLOADS: dict[str, dict[str, Any]] = {
    "tiny": {"batch": 8, "steps": 200, "quick_steps": 100},
    "mlp": {"batch": 64, "steps": 20, "quick_steps": 10},
}
PRECISIONS = ("fp32", "bf16")
N_BATCHES = 8
#: A second copy of the raw loop, timed in the same interleaving: its difference to ``raw`` is
#: the noise floor of the run (an A/A test).
CONTROL = "raw_copy"


def make_model(workload: str) -> torch.nn.Module:
    """The workload's model, identically initialised on every call."""
    torch.manual_seed(0)
    if workload == "tiny":
        return torch.nn.Linear(16, 16)
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))


def make_batches(workload: str, seed: int = 1) -> tuple[list[Batch], LossFn]:
    """``N_BATCHES`` fixed batches and the loss function of the workload."""
    gen = torch.Generator().manual_seed(seed)
    size = WORKLOADS[workload]["batch"]
    if workload == "tiny":
        batches = [
            (torch.randn(size, 16, generator=gen), torch.randn(size, 16, generator=gen))
            for _ in range(N_BATCHES)
        ]
        return batches, torch.nn.functional.mse_loss
    batches = [
        (torch.randn(size, 512, generator=gen), torch.randint(0, 10, (size,), generator=gen))
        for _ in range(N_BATCHES)
    ]
    return batches, torch.nn.functional.cross_entropy


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Plain SGD (the same for every implementation)."""
    return torch.optim.SGD(model.parameters(), lr=1e-3)


def _decay(step: int) -> float:
    return 1.0 / (1.0 + 1e-3 * step)


def make_scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A ``LambdaLR`` changing the learning rate every step (the same for every
    implementation)."""
    return torch.optim.lr_scheduler.LambdaLR(opt, _decay)


# -- the loops (kept minimal and identical but for the framework calls) ------------------------


def raw_loop_fp32(
    model: torch.nn.Module,
    opt: Any,
    data: Sequence[Batch],
    loss_fn: LossFn,
    sched: Any = None,
) -> None:
    """Raw PyTorch, full precision: no context manager at all."""
    for x, y in data:
        loss = loss_fn(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        if sched is not None:  # the same test in every loop
            sched.step()


def raw_loop_bf16(
    model: torch.nn.Module,
    opt: Any,
    data: Sequence[Batch],
    loss_fn: LossFn,
    sched: Any = None,
) -> None:
    """Raw PyTorch, bf16 autocast on CPU."""
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        if sched is not None:  # the same test in every loop
            sched.step()


def framework_loop(
    accelerator: Any,
    model: torch.nn.Module,
    opt: Any,
    data: Sequence[Batch],
    loss_fn: LossFn,
    sched: Any = None,
) -> None:
    """The loop through an Accelerator (kwplug's or Accelerate's: same code)."""
    for x, y in data:
        with accelerator.autocast():
            loss = loss_fn(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        if sched is not None:  # the same test in every loop
            sched.step()


# -- setup per implementation ------------------------------------------------------------------


def reset_accelerate() -> None:
    """Forget Accelerate's process-wide singletons (so another precision can be chosen)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def make_accelerator(impl: str, precision: str) -> Any:
    """An Accelerator of ``impl`` on the CPU for ``precision``."""
    mixed = "no" if precision == "fp32" else precision
    if impl == "kwplug":
        import kwplug

        return kwplug.Accelerator(mixed_precision=mixed, cpu=True)
    import accelerate

    reset_accelerate()
    accelerator = accelerate.Accelerator(mixed_precision=mixed, cpu=True)
    torch.set_num_threads(1)  # whatever Accelerate's CPU setup chose
    return accelerator


def blocks_for(
    workload: str, precision: str, impls: Sequence[str], steps: int
) -> tuple[dict[str, Callable[[], float]], dict[str, torch.nn.Module]]:
    """One timing block per implementation (``steps`` steps, seconds per step) and the models."""
    batches, loss_fn = make_batches(workload)
    data = list(itertools.islice(itertools.cycle(batches), steps))
    blocks: dict[str, Callable[[], float]] = {}
    models: dict[str, torch.nn.Module] = {}
    for impl in impls:
        run, models[impl] = trainer(impl, workload, precision, data, loss_fn)
        blocks[impl] = block(run, steps)
    return blocks, models


def trainer(
    impl: str, workload: str, precision: str, data: Sequence[Batch], loss_fn: LossFn
) -> tuple[Callable[[int], None], torch.nn.Module]:
    """``run(n)`` training ``impl``'s copy of the model over ``data``, and that model."""
    model = make_model(workload)
    opt = make_optimizer(model)
    sched = make_scheduler(opt)
    if impl in ("raw", CONTROL):
        loop = raw_loop_fp32 if precision == "fp32" else raw_loop_bf16

        def run_raw(n: int) -> None:
            loop(model, opt, data, loss_fn, sched)

        return run_raw, model
    accelerator = make_accelerator(impl, precision)
    model, opt, sched = accelerator.prepare(model, opt, sched)

    def run(n: int) -> None:
        framework_loop(accelerator, model, opt, data, loss_fn, sched)

    return run, model


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Bitwise equality of all parameters."""
    pa, pb = list(a.parameters()), list(b.parameters())
    return len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))


def run(quick: bool, with_accelerate: bool) -> Result:
    """Measure every workload x precision; see the module docstring."""
    impls = ["raw", "kwplug"] + (["accelerate"] if with_accelerate else [])
    reps = 3 if quick else 61
    result = Result("step_overhead", quick)
    equal: dict[str, dict[str, bool]] = {}
    controls: dict[str, dict[str, float | None]] = {}
    samples_by_case: dict[str, Samples] = {}
    for workload in WORKLOADS:
        steps = WORKLOADS[workload]["quick_steps" if quick else "steps"]
        for precision in PRECISIONS:
            case = f"{workload} {precision}"
            blocks, models = blocks_for(workload, precision, [*impls, CONTROL], steps)
            samples = interleave(blocks, reps=reps, warmup=1)
            samples_by_case[case] = samples
            control = samples.pop(CONTROL)
            row = timing_row(f"{case} step", samples, unit="steps/s", rate=True)
            aa = timing_row("A/A", {"raw": samples["raw"], "kwplug": control}, rate=True)
            row.note = (
                "A/A control (a second raw copy vs raw, same run): "
                f"{aa.kwplug_extra:+.2f} µs/step, {aa.kwplug_vs_raw:.3f}x -- this row's noise floor"
            )
            controls[case] = {"extra_us": aa.kwplug_extra, "vs_raw": aa.kwplug_vs_raw}
            result.rows.append(row)
            equal[case] = {
                impl: params_equal(models["raw"], models[impl]) for impl in [*impls[1:], CONTROL]
            }
            if with_accelerate:
                reset_accelerate()
    result.checks = {
        "params_equal": equal,
        "kwplug_params_equal_raw": all(e["kwplug"] for e in equal.values()),
    }
    result.info = {
        "reps": reps,
        "steps_per_block": {
            w: WORKLOADS[w]["quick_steps" if quick else "steps"] for w in WORKLOADS
        },
        "samples_s_per_step": samples_by_case,
        "aa_control": controls,
    }
    rows = {row.case: row for row in result.rows}
    for precision, limit in (("fp32", 5.0), ("bf16", 8.0)):
        result.targets.append(
            Target(
                f"tiny {precision}: kwplug extra per step",
                rows[f"tiny {precision} step"].kwplug_extra,
                "<=",
                limit,
                "µs",
                noise=controls[f"tiny {precision}"]["extra_us"],
            )
        )
    for precision in PRECISIONS:
        result.targets.append(
            Target(
                f"mlp {precision}: kwplug throughput vs raw",
                rows[f"mlp {precision} step"].kwplug_vs_raw,
                ">=",
                0.99,
                "x",
                noise=controls[f"mlp {precision}"]["vs_raw"],
            )
        )
    return result


def main(argv: Sequence[str] | None = None) -> Result:
    """``python -m benchmarks.step_overhead``; fails unless kwplug's parameters equal raw's."""
    result = run_main("step_overhead", DESCRIPTION, run, argv)
    assert result.checks["kwplug_params_equal_raw"], (
        f"kwplug's parameters differ from the raw loop's: {result.checks['params_equal']}"
    )
    return result


if __name__ == "__main__":
    main()

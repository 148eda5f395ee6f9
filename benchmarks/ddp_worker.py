"""Worker of :mod:`benchmarks.ddp_2proc`, one per rank, launched by torchrun (gloo, CPU).

For each communication hook (none, fp16, bf16, power_sgd, batched_power_sgd) it builds three
DDP trainings of the 512-512-10 MLP (batch 64 per rank) from the same initial weights:

- ``raw``: ``DistributedDataParallel(model)`` with the hook registered by hand through
  ``register_comm_hook(state, hook)`` -- the *same* hook function and state kwplug uses
  (``kwplug.plugins.ddp_comm_hooks``), so the ratio isolates framework cost;
- ``kwplug``: ``Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(
  comm_hook=..., comm_state_option=...)]).prepare(model, optimizer)``;
- ``accelerate``: the same through Hugging Face Accelerate (torch's own hooks).

It times blocks of steps interleaved (A B C, C B A, ...), then measures the bytes every hook
all-reduces per step by counting the tensors passed to ``torch.distributed.all_reduce`` (what
the Python hooks call). DDP's own all-reduce (no hook) runs in C++; its bytes are measured by
running torch's equivalent Python ``allreduce_hook`` through the same counter. Rank 0 writes
the JSON result to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._common import interleave, timed
from benchmarks.step_overhead import (
    Batch,
    framework_loop,
    make_batches,
    make_model,
    make_optimizer,
    raw_loop_fp32,
)

HOOKS: tuple[str, ...] = ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd")
#: Comma-separated subset of HOOKS to run (default: all), e.g. ``KWPLUG_BENCH_DDP_HOOKS=no,fp16``.
HOOKS_ENV = "KWPLUG_BENCH_DDP_HOOKS"
POWER_SGD_OPTIONS: dict[str, Any] = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
PROBE_STEPS = 4  # past start_powerSGD_iter, so compression runs before timing starts
COUNT_STEPS = 3


class AllReduceCounter:
    """Replaces ``torch.distributed.all_reduce`` while active; counts calls and bytes."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self._original: Callable[..., Any] = dist.all_reduce

    def __call__(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.bytes += tensor.numel() * tensor.element_size()
        return self._original(tensor, *args, **kwargs)

    def __enter__(self) -> AllReduceCounter:
        self.calls = self.bytes = 0
        dist.all_reduce = self
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._original


def hook_options(hook: str) -> dict[str, Any]:
    """``comm_state_option`` for ``hook``."""
    return dict(POWER_SGD_OPTIONS) if "power_sgd" in hook else {}


Trainer = tuple[Callable[[Sequence[Batch]], None], torch.nn.Module]


def build_raw(hook: str, loss_fn: Any) -> Trainer:
    """Hand-written DDP, the hook registered directly."""
    from kwplug.plugins import ddp_comm_hooks

    model = make_model("mlp")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if hook != "no":
        record = ddp_comm_hooks.builtin_comm_hooks()[hook]
        ddp.register_comm_hook(record.build_state(None, hook_options(hook)), record.hook)
    opt = make_optimizer(ddp)
    return (lambda data: raw_loop_fp32(ddp, opt, data, loss_fn)), ddp


def build_kwplug(hook: str, loss_fn: Any) -> Trainer:
    """kwplug's Accelerator with ``DistributedDataParallelKwargs(comm_hook=hook)``."""
    import kwplug

    handler = kwplug.DistributedDataParallelKwargs(
        comm_hook=hook, comm_state_option=hook_options(hook)
    )
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])
    model = make_model("mlp")
    model, opt = accelerator.prepare(model, make_optimizer(model))
    return (lambda data: framework_loop(accelerator, model, opt, data, loss_fn)), model


def build_accelerate(hook: str, loss_fn: Any) -> Trainer:
    """Accelerate's Accelerator with its ``DistributedDataParallelKwargs(comm_hook=hook)``."""
    import accelerate
    from accelerate.utils import DDPCommunicationHookType

    handler = accelerate.DistributedDataParallelKwargs(
        comm_hook=DDPCommunicationHookType(hook), comm_state_option=hook_options(hook)
    )
    accelerator = accelerate.Accelerator(cpu=True, kwargs_handlers=[handler])
    torch.set_num_threads(1)
    model = make_model("mlp")
    model, opt = accelerator.prepare(model, make_optimizer(model))
    return (lambda data: framework_loop(accelerator, model, opt, data, loss_fn)), model


#: A second raw DDP, timed in the same interleaving: the run's noise floor (A/A test).
CONTROL = "raw_copy"

BUILDERS: dict[str, Callable[[str, Any], Trainer]] = {
    "raw": build_raw,
    CONTROL: build_raw,
    "kwplug": build_kwplug,
    "accelerate": build_accelerate,
}


def agree(ok: bool) -> bool:
    """True when ``ok`` on every rank."""
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def default_allreduce_bytes(data: Sequence[Batch], loss_fn: Any) -> dict[str, float]:
    """Bytes DDP's built-in all-reduce sends per step, via torch's Python ``allreduce_hook``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = torch.nn.parallel.DistributedDataParallel(make_model("mlp"))
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = make_optimizer(ddp)
    raw_loop_fp32(ddp, opt, data[:1], loss_fn)
    with AllReduceCounter() as counter:
        raw_loop_fp32(ddp, opt, data[:COUNT_STEPS], loss_fn)
    return {"bytes": counter.bytes / COUNT_STEPS, "calls": counter.calls / COUNT_STEPS}


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Bitwise equality of all parameters."""
    pa, pb = list(a.parameters()), list(b.parameters())
    return len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))


def synced_block(step: Callable[[Sequence[Batch]], None], data: Sequence[Batch]) -> float:
    """Seconds per step of ``step(data)``, started together on every rank."""
    dist.barrier()
    return timed(lambda n: step(data[:n]), len(data))


def bench_hook(
    hook: str, impls: Sequence[str], data: Sequence[Batch], loss_fn: Any, reps: int
) -> dict[str, Any]:
    """Time, count and compare every implementation for one hook."""
    trainers: dict[str, Trainer] = {}
    errors: dict[str, str] = {}
    for impl in impls:
        try:
            trainer = BUILDERS[impl](hook, loss_fn)
            trainer[0](data[:PROBE_STEPS])
            ok = True
        except Exception as exc:  # e.g. a hook Accelerate cannot run on CPU/gloo
            first_line = (str(exc).strip().splitlines() or [""])[0][:200]
            errors[impl] = f"{type(exc).__name__}: {first_line}".rstrip(": ")
            ok = False
        if agree(ok):
            trainers[impl] = trainer
        else:
            errors.setdefault(impl, "failed on another rank")

    blocks = {impl: functools.partial(synced_block, trainers[impl][0], data) for impl in trainers}
    samples = interleave(blocks, reps=reps, warmup=1)
    counted: dict[str, dict[str, float]] = {}
    for impl, (step, _model) in trainers.items():
        with AllReduceCounter() as counter:
            step(data[:COUNT_STEPS])
        counted[impl] = {"bytes": counter.bytes / COUNT_STEPS, "calls": counter.calls / COUNT_STEPS}
    equal = {
        impl: params_equal(trainers["raw"][1], model)
        for impl, (_step, model) in trainers.items()
        if impl != "raw" and "raw" in trainers
    }
    return {
        "samples_s_per_step": samples,
        "allreduce_per_step": counted,
        "errors": errors,
        "params_equal_raw": equal,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point under torchrun."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-accelerate", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    impls = ["raw", "kwplug"] + ([] if args.no_accelerate else ["accelerate"])
    steps = 5 if args.quick else 10
    reps = 2 if args.quick else 31
    batches, loss_fn = make_batches("mlp", seed=100 + rank)
    data = (batches * (steps // len(batches) + 1))[:steps]
    results = {"no_hook_builtin_allreduce": default_allreduce_bytes(data, loss_fn)}
    selected = [h for h in os.environ.get(HOOKS_ENV, "").split(",") if h] or list(HOOKS)
    unknown = sorted(set(selected) - set(HOOKS))
    if unknown:
        raise ValueError(f"{HOOKS_ENV}: unknown hooks {unknown}; known: {HOOKS}")
    hooks = {hook: bench_hook(hook, [*impls, CONTROL], data, loss_fn, reps) for hook in selected}
    if rank == 0:
        out = {
            "world_size": dist.get_world_size(),
            "steps_per_block": steps,
            "reps": reps,
            "impls": impls,
            "torch_threads": torch.get_num_threads(),
            "hooks": hooks,
            **results,
        }
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(out, handle, indent=2)
    dist.barrier()
    # Collect the DDP modules and hook states (torch's PowerSGD callbacks hold the group)
    # before the group goes: one collected later, on a gloo thread, can abort the process.
    gc.collect()
    time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

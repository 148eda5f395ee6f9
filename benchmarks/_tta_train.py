"""One rank's training to the target accuracy, for :mod:`benchmarks.bandwidth_accuracy`: the
digits data, the model and the three systems' set-ups (raw DDP, Accelerate, kwplug)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

TARGET = 0.95
EVAL_EVERY = 10
MAX_STEPS = 3000
BATCH = 32
#: Local SGD averages every 5 steps: the evaluations (every 10) see averaged weights.
LOCAL_SGD_STEPS = 5

#: (model, optimizer, backward, context per step, after each optimizer step, unwrap)
Setup = tuple[
    torch.nn.Module,
    torch.optim.Optimizer,
    Callable[[torch.Tensor], None],
    Callable[[], contextlib.AbstractContextManager[Any]],
    Callable[[], None],
    Callable[[], torch.nn.Module],
]


def data() -> tuple[torch.Tensor, ...]:
    """(x_train, x_test, y_train, y_test): digits scaled to [0, 1], 20% held out, stratified."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    return tuple(train_test_split(x, y, test_size=0.2, stratify=y, random_state=0))


def model(width: int) -> torch.nn.Module:
    """The 64-``width``-``width/2``-10 MLP, seeded: the same weights on every call."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width // 2),
        torch.nn.ReLU(), torch.nn.Linear(width // 2, 10),
    )  # fmt: skip


def _optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)


def _raw(hook: str, options: dict[str, Any], width: int) -> Setup:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    ddp = torch.nn.parallel.DistributedDataParallel(model(width))
    opt = _optimizer(ddp)
    after: Callable[[], None] = lambda: None  # noqa: E731
    context: Callable[[], Any] = contextlib.nullcontext
    if hook in ("fp16", "bf16"):
        ddp.register_comm_hook(None, getattr(default_hooks, f"{hook}_compress_hook"))
    elif hook == "power_sgd":
        ddp.register_comm_hook(
            powerSGD_hook.PowerSGDState(None, **options), powerSGD_hook.powerSGD_hook
        )
    elif hook == "power_sgd_inplace":  # kwplug's function and state, registered by hand
        from kwplug.plugins import ddp_comm_hooks

        state = ddp_comm_hooks.make_power_sgd_state(None, options)
        ddp.register_comm_hook(state, ddp_comm_hooks.power_sgd_inplace_hook)
    elif hook in ("int8", "topk"):
        import kwplug_compress as kc

        make = kc.make_int8_state if hook == "int8" else kc.make_topk_state
        ddp.register_comm_hook(make(None, options), getattr(kc, f"{hook}_hook"))
    elif hook == "local_sgd":
        from torch.distributed.algorithms.model_averaging.averagers import (
            PeriodicModelAverager,
        )

        # warmup_steps=period-1: it averages after steps 5, 10, ... like the LocalSGD classes
        averager = PeriodicModelAverager(LOCAL_SGD_STEPS, warmup_steps=LOCAL_SGD_STEPS - 1)
        context, after = ddp.no_sync, lambda: averager.average_parameters(ddp.parameters())
    return ddp, opt, torch.autograd.backward, context, after, lambda: ddp.module


def _library(name: str, hook: str, options: dict[str, Any], width: int) -> Setup:
    import importlib

    lib = importlib.import_module(name)
    ddp_hook = "no" if hook == "local_sgd" else hook
    if name == "accelerate":
        from accelerate.utils import DDPCommunicationHookType

        kwargs = lib.DistributedDataParallelKwargs(
            comm_hook=DDPCommunicationHookType(ddp_hook), comm_state_option=options
        )
    else:
        kwargs = lib.DistributedDataParallelKwargs(comm_hook=ddp_hook, comm_state_option=options)
    accelerator = lib.Accelerator(cpu=True, kwargs_handlers=[kwargs])
    torch.set_num_threads(1)  # Accelerate sets its own thread count
    plain = model(width)
    prepared, opt = accelerator.prepare(plain, _optimizer(plain))
    after: Callable[[], None] = lambda: None  # noqa: E731
    context: Callable[[], Any] = contextlib.nullcontext
    if hook == "local_sgd":
        local_sgd = importlib.import_module(f"{name}.local_sgd").LocalSGD(
            accelerator, prepared, local_sgd_steps=LOCAL_SGD_STEPS, enabled=True
        )
        local_sgd.__enter__()  # it holds a counter for the life of the run
        context = lambda: accelerator.no_sync(prepared)  # noqa: E731
        after = local_sgd.step
    return (
        prepared, opt, accelerator.backward, context, after,
        lambda: accelerator.unwrap_model(prepared),
    )  # fmt: skip


def train(system: str, hook: str, options: dict[str, Any], width: int) -> dict[str, Any]:
    """Train with ``system``'s ``hook`` until :data:`TARGET` held-out accuracy or
    :data:`MAX_STEPS`; rank 0's view (seconds is None when the target was not reached)."""
    x_train, x_test, y_train, y_test = data()
    if system == "raw":
        setup = _raw(hook, options, width)
    else:
        setup = _library(system, hook, options, width)
    net, opt, backward, context, after, unwrap = setup
    rank, world = dist.get_rank(), dist.get_world_size()
    shard_x, shard_y = x_train[rank::world], y_train[rank::world]
    per_epoch = len(shard_y) // BATCH
    gen = torch.Generator().manual_seed(rank)
    order = torch.randperm(len(shard_y), generator=gen)
    accuracy, done = 0.0, torch.zeros(1)
    dist.barrier()
    start = time.perf_counter()
    step = 0
    while step < MAX_STEPS:
        if step % per_epoch == 0:
            order = torch.randperm(len(shard_y), generator=gen)
        index = order[(step % per_epoch) * BATCH : (step % per_epoch + 1) * BATCH]
        with context():
            backward(torch.nn.functional.cross_entropy(net(shard_x[index]), shard_y[index]))
        opt.step()
        after()
        opt.zero_grad()
        step += 1
        if step % EVAL_EVERY == 0:
            if rank == 0:
                with torch.no_grad():
                    predicted = unwrap()(x_test).argmax(1)
                accuracy = float((predicted == y_test).float().mean())
                done.fill_(float(accuracy >= TARGET))
            dist.broadcast(done, 0)
            if done.item():
                break
    seconds = time.perf_counter() - start
    return {
        "steps": step,
        "seconds": seconds if done.item() else None,
        "accuracy": accuracy,
        "ms_per_step": seconds / step * 1e3,
    }

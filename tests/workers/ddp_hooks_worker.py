"""Worker for tests/handlers/test_ddp_torchrun.py: train under each DDP communication hook config.

Run by torchrun with 2 CPU processes. For each config (a fresh Accelerator, model and DDP), it
trains a small regression MLP on rank-specific data and records: the evaluation loss before
and after, whether the gradients of the last step and the final parameters are identical on
every rank, whether the synced gradients are exactly representable in float16/bfloat16 (they
are when the all-reduce ran in that precision), PowerSGD statistics, the hook name DDP
logged, and how often custom hooks were called. Rank 0 prints one line
``KWPLUG_RESULT <json>``.

This module deliberately uses ``from __future__ import annotations``: ``counting_hook`` has
string annotations, which DDP's own hook check would reject without kwplug's adapter.
"""

from __future__ import annotations

import functools
import gc
import json
from typing import Any

import torch
import torch.distributed as dist

import kwplug
from kwplug import DDPCommunicationHookType, DistributedDataParallelKwargs

STEPS = 30
PSGD = {"start_powerSGD_iter": 2, "matrix_approximation_rank": 1}
CALLS: dict[str, int] = {"named": 0, "plain": 0, "object": 0, "partial": 0}


class CountingState:
    """State of the named custom hook, built by ``make_counting_state`` from the options."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.calls = 0


def make_counting_state(process_group: Any, options: dict[str, Any]) -> CountingState:
    return CountingState(tag=options.get("tag", ""))


def _mean_allreduce(bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def counting_hook(
    state: CountingState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    state.calls += 1
    CALLS["named"] += 1
    return _mean_allreduce(bucket)


def plain_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    assert state is None, state
    CALLS["plain"] += 1
    return _mean_allreduce(bucket)


class ObjectHook:
    """A callable object whose parameter is not named ``bucket`` (DDP alone would fail)."""

    def __call__(self, state: Any, grad_bucket: dist.GradBucket) -> Any:
        CALLS["object"] += 1
        return _mean_allreduce(grad_bucket)


def partial_hook(key: str, state: Any, bucket: dist.GradBucket) -> Any:
    CALLS[key] += 1
    return _mean_allreduce(bucket)


CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("baseline", {}),
    ("fp16", {"comm_hook": "fp16"}),
    ("bf16", {"comm_hook": DDPCommunicationHookType.BF16}),
    ("power_sgd", {"comm_hook": "power_sgd", "comm_state_option": PSGD}),
    ("batched_power_sgd", {"comm_hook": "batched_power_sgd", "comm_state_option": PSGD}),
    ("fp16_wrapper_default", {"comm_wrapper": "fp16"}),
    ("bf16_wrapper_default", {"comm_wrapper": DDPCommunicationHookType.BF16}),
    (
        "fp16_wrapper_power_sgd",
        {"comm_hook": "power_sgd", "comm_wrapper": "fp16", "comm_state_option": PSGD},
    ),
    (
        "bf16_wrapper_power_sgd",
        {"comm_hook": "power_sgd", "comm_wrapper": "bf16", "comm_state_option": PSGD},
    ),
    (
        "bf16_wrapper_batched_power_sgd",
        {"comm_hook": "batched_power_sgd", "comm_wrapper": "bf16", "comm_state_option": PSGD},
    ),
    ("named_custom", {"comm_hook": "counting", "comm_state_option": {"tag": "hello"}}),
    ("plain_callable", {"comm_hook": plain_hook}),
    ("object_callable", {"comm_hook": ObjectHook()}),
    (
        "partial_callable_bf16_wrapper",
        {"comm_hook": functools.partial(partial_hook, "partial"), "comm_wrapper": "bf16"},
    ),
]


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def make_data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w_true = torch.randn(16, 1, generator=g)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return x, x @ w_true + 0.01 * torch.randn(n, 1, generator=g)


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def same_on_all_ranks(tensor: torch.Tensor) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def representable(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return bool(torch.equal(tensor, tensor.to(dtype).to(tensor.dtype)))


def run_config(kwargs: dict[str, Any]) -> dict[str, Any]:
    accelerator = kwplug.Accelerator(
        cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(**kwargs)]
    )
    rank = accelerator.process_index
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)
    x, y = make_data(100 + rank, 64)  # each rank sees different data
    x_eval, y_eval = make_data(7, 256)
    loss_fn = torch.nn.MSELoss()
    with torch.no_grad():
        loss_before = loss_fn(ddp.module(x_eval), y_eval).item()
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        batch = slice((step * 16) % 64, (step * 16) % 64 + 16)
        loss = loss_fn(ddp(x[batch]), y[batch])
        accelerator.backward(loss)
        losses.append(loss.item())
        if step < STEPS - 1:
            optimizer.step()
    grads = flat([p.grad for p in ddp.parameters()])
    first_weight_grad = ddp.module[0].weight.grad.detach().clone()
    optimizer.step()
    with torch.no_grad():
        loss_after = loss_fn(ddp.module(x_eval), y_eval).item()
    params = flat(list(ddp.parameters()))

    hooks = getattr(ddp, "_comm_hooks", [])  # torch-private: [(hook, state)] registered
    state = hooks[0][1] if hooks else None
    logged = ddp._get_ddp_logging_data().get("comm_hook", "")
    result: dict[str, Any] = {
        "loss_before": loss_before,
        "loss_after": loss_after,
        "grads_equal": same_on_all_ranks(grads),
        "params_equal": same_on_all_ranks(params),
        "grads_fp16": representable(grads, torch.float16),
        "grads_bf16": representable(grads, torch.bfloat16),
        "first_weight_grad_rank": int(torch.linalg.matrix_rank(first_weight_grad)),
        "num_hooks": len(hooks),
        "logged_hook": logged,
        "hook_names": [getattr(h, "__qualname__", repr(h)) for h, _ in hooks],
    }
    if state is not None and hasattr(state, "total_numel_after_compression"):
        result["psgd_iter"] = state.iter
        result["psgd_numel_after"] = state.total_numel_after_compression
        result["psgd_numel_before"] = state.total_numel_before_compression
        result["psgd_rank"] = state.matrix_approximation_rank
    if isinstance(state, CountingState):
        result["state_tag"] = state.tag
        result["state_calls"] = state.calls
    return result


def main() -> None:
    kwplug.register_comm_hook("counting", counting_hook, make_state=make_counting_state)
    results: dict[str, Any] = {}
    for name, kwargs in CONFIGS:
        before = dict(CALLS)
        results[name] = run_config(kwargs)
        results[name]["calls"] = {k: CALLS[k] - before[k] for k in CALLS}
    accelerator = kwplug.Accelerator(cpu=True)
    results["_comm_hooks"] = {k: v.source for k, v in accelerator.comm_hooks.items()}
    everyone: list[Any] = [None] * accelerator.num_processes
    dist.all_gather_object(everyone, {k: v.get("calls") for k, v in results.items()})
    results["_calls_per_rank"] = everyone
    results["_world_size"] = accelerator.num_processes
    if accelerator.is_main_process:
        print("KWPLUG_RESULT " + json.dumps(results), flush=True)
    # Every DDP module must be gone before the process group is destroyed: one that outlives
    # it (here: in a reference cycle until interpreter exit) sometimes aborts the process at
    # exit ("terminate called without an active exception").
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main()

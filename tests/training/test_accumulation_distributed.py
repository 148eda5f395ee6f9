"""Gradient accumulation in 2 CPU processes: the DDP communication hook under no_sync (every
built-in hook and the kwplug-compress hooks), static_graph, and the FSDP2 plugin."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kwplug.testing import run_distributed

HOOKS = ["no", "fp16", "bf16", "power_sgd", "batched_power_sgd", "int8", "topk"]
STEPS = 3  # micro-batches per optimizer step
MICRO = 4  # samples per rank per micro-batch
ROUNDS = 2  # optimizer steps


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    samples = ROUNDS * STEPS * 2 * MICRO
    return torch.randn(samples, 6, generator=generator), torch.randn(
        samples, 1, generator=generator
    )


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _micro_batch(rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Micro-batch `index` of the global batch stream; each rank takes its half.
    x, y = _data()
    start = index * 2 * MICRO + rank * MICRO
    return x[start : start + MICRO], y[start : start + MICRO]


def _reference() -> list[torch.Tensor]:
    # No accumulation, one process: each optimizer step on the whole global batch.
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    size = STEPS * 2 * MICRO
    for round_ in range(ROUNDS):
        batch = slice(round_ * size, (round_ + 1) * size)
        torch.nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _same_on_every_rank(tensor: torch.Tensor) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, tensor.contiguous())
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def _train_with_hook(hook: str, static_graph: bool) -> dict[str, Any]:
    import warnings

    import kwplug
    import kwplug.plugins.ddp_comm_hooks._compose as table

    calls: list[int] = []
    original = table.ddp_compatible_hook

    def counting(fn: Any) -> Any:
        def counted(state: Any, bucket: Any) -> Any:
            calls.append(bucket.index())
            return fn(state, bucket)

        return original(counted)  # made acceptable to DDP (annotations) like any hook

    table.ddp_compatible_hook = counting  # compose() ends every registered hook with it
    try:
        handler = kwplug.DistributedDataParallelKwargs(comm_hook=hook, static_graph=static_graph)
        accelerator = kwplug.Accelerator(
            cpu=True, gradient_accumulation_steps=STEPS, kwargs_handlers=[handler]
        )
        model = _model()
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    finally:
        table.ddp_compatible_hook = original
    state = model._comm_hooks[0][1] if model._comm_hooks else None
    steps: list[dict[str, Any]] = []
    for index in range(ROUNDS * STEPS):
        x, y = _micro_batch(accelerator.process_index, index)
        before = len(calls)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            context = accelerator.accumulate(model)
            context.__enter__()
        try:
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            grad = model.module[0].weight.grad
            steps.append(
                {
                    "sync": accelerator.sync_gradients,
                    "buckets": calls[before:],
                    "same_grads": _same_on_every_rank(grad),
                    "iter": getattr(state, "iter", None),
                    "warnings": [str(w.message) for w in caught],
                }
            )
            optimizer.step()
            optimizer.zero_grad()
        finally:
            context.__exit__(None, None, None)
    weights = [p.detach().clone() for p in model.module.parameters()]
    return {"steps": steps, "weights": weights, "no_sync": accelerator.plan["no_sync"].plugin}


def ddp_hooks_worker() -> dict[str, Any]:
    """Run in each rank: accumulate under every hook, and static_graph with two of them."""
    results = {hook: _train_with_hook(hook, False) for hook in HOOKS}
    for hook in ("no", "power_sgd"):
        results[f"{hook}+static_graph"] = _train_with_hook(hook, True)
    return results


@pytest.fixture(scope="module")
def ddp_ranks() -> list[dict[str, Any]]:
    pytest.importorskip("kwplug_compress")
    return run_distributed(ddp_hooks_worker, nproc=2, timeout=400)


@pytest.mark.parametrize("case", [*HOOKS, "no+static_graph", "power_sgd+static_graph"])
def test_comm_hook_runs_only_on_sync_steps(ddp_ranks: list[dict[str, Any]], case: str) -> None:
    hook, _, static = case.partition("+")
    for rank in ddp_ranks:
        result = rank[case]
        assert "DistributedDataParallelKwargs" in result["no_sync"]
        syncs = [step["sync"] for step in result["steps"]]
        assert syncs == [False, False, True] * ROUNDS
        warned = [w for step in result["steps"] for w in step["warnings"]]
        if static:
            # torch's no_sync is broken with a static graph: kwplug synchronises every
            # micro-batch instead, and says so once.
            assert len(warned) == 1 and "static_graph" in warned[0]
            assert all(step["same_grads"] for step in result["steps"])
            if hook == "power_sgd":
                assert [step["iter"] for step in result["steps"]] == [1, 2, 3, 4, 5, 6]
            continue
        assert warned == []
        for step in result["steps"]:
            if hook == "no":  # DDP's own all-reduce: no Python hook at all
                assert step["buckets"] == []
            elif step["sync"]:  # once per bucket
                assert sorted(step["buckets"]) == list(range(len(step["buckets"]))) != []
            else:
                assert step["buckets"] == []
            # Local gradients differ between ranks until the synchronising backward.
            assert step["same_grads"] is step["sync"]
        if hook in ("power_sgd", "batched_power_sgd"):
            # The step counter advances once per synchronising backward only.
            assert [step["iter"] for step in result["steps"]] == [0, 0, 1, 1, 1, 2]


@pytest.mark.parametrize("case", ["no", "fp16", "no+static_graph"])
def test_accumulated_ddp_training_equals_full_batch_training(
    ddp_ranks: list[dict[str, Any]], case: str
) -> None:
    # float32: the gradient is summed per micro-batch, across micro-batches and across ranks
    # instead of over one batch of 24, and fp16 rounds the all-reduced values to 11 bits:
    # a few ulps for "no" (rtol 1e-5 is ~100 ulps), 2**-11 relative for fp16.
    tolerance = {"rtol": 2e-3, "atol": 1e-4} if case == "fp16" else {"rtol": 1e-5, "atol": 1e-6}
    reference = _reference()
    for rank in ddp_ranks:
        for ours, theirs in zip(rank[case]["weights"], reference, strict=True):
            torch.testing.assert_close(ours, theirs, **tolerance)


def fsdp_worker() -> dict[str, Any]:
    """Run in each rank: accumulate a model sharded by the kwplug-fsdp plugin."""
    from kwplug_fsdp import FullyShardedKwargs

    import kwplug

    accelerator = kwplug.Accelerator(
        cpu=True, gradient_accumulation_steps=STEPS, kwargs_handlers=[FullyShardedKwargs()]
    )
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    toggles: list[bool] = []
    original = model.set_requires_gradient_sync

    def counted(requires: bool, *args: Any, **kwargs: Any) -> None:
        toggles.append(requires)
        original(requires, *args, **kwargs)

    model.set_requires_gradient_sync = counted  # what the plugin's no_sync calls
    syncs = []
    for index in range(ROUNDS * STEPS):
        x, y = _micro_batch(accelerator.process_index, index)
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            syncs.append(accelerator.sync_gradients)
            optimizer.step()
            optimizer.zero_grad()
    full = [p.full_tensor().detach().clone() for p in model.parameters()]
    return {
        "weights": full,
        "syncs": syncs,
        "toggles": toggles,
        "no_sync": accelerator.plan["no_sync"].plugin,
    }


def test_fsdp2_plugin_accumulates() -> None:
    pytest.importorskip("kwplug_fsdp")
    ranks = run_distributed(fsdp_worker, nproc=2, timeout=300)
    reference = _reference()
    for rank in ranks:
        assert rank["no_sync"] is not None and "fsdp" in rank["no_sync"]
        assert rank["syncs"] == [False, False, True] * ROUNDS
        # Off and back on around each non-synchronising micro-batch, never on a sync step.
        assert rank["toggles"] == [False, True] * (ROUNDS * (STEPS - 1))
        for ours, theirs in zip(rank["weights"], reference, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)

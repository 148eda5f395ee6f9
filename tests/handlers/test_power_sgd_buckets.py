"""PowerSGD with several DDP buckets on gloo trains to identical ranks (it used to hang: the
second all-reduce of a bucket, started from a gloo callback thread, raced with the next
bucket's first all-reduce), and the ordered chain that fixes it without blocking backward
computes exactly what the blocking ``serialized_hook`` did."""

from __future__ import annotations

from typing import Any

import torch

import kwplug
from kwplug.testing import run_distributed

# (hook, comm_wrapper, find_unused_parameters): with unused parameters DDP all-reduces its
# used-parameter map on the same group right after the last bucket's hook.
CONFIGS = [
    ("power_sgd", "no", False),
    ("batched_power_sgd", "no", False),
    ("power_sgd", "bf16", False),
    ("batched_power_sgd", "fp16", False),
    ("power_sgd", "no", True),
]


def train_many_buckets(blocking: bool = False) -> list[dict[str, Any]]:
    """Runs on every rank: each config on a 6-layer MLP split into several small buckets;
    ``blocking``: with the former blocking ``serialized_hook`` instead of the ordered chain."""
    if blocking:
        from kwplug.plugins.ddp_comm_hooks import _compose, serialized_hook

        _compose.ordered_hook = serialized_hook  # type: ignore[assignment]
    results = []
    for hook, wrapper, unused in CONFIGS:
        if blocking and hook == "batched_power_sgd":
            continue  # orders its collectives itself: neither wrapper applies
        torch.manual_seed(0)
        handler = kwplug.DistributedDataParallelKwargs(
            comm_hook=hook,
            comm_wrapper=wrapper,
            bucket_cap_mb=0.02,  # ~20 kB: a bucket per layer or two
            find_unused_parameters=unused,
            comm_state_option={"matrix_approximation_rank": 2, "start_powerSGD_iter": 2},
        )
        accelerator = kwplug.Accelerator(kwargs_handlers=[handler])
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer = accelerator.prepare(model, optimizer)
        generator = torch.Generator().manual_seed(accelerator.process_index)
        target = torch.randn(64, 64, generator=torch.Generator().manual_seed(7))
        losses = []
        for _ in range(25):
            x = torch.randn(32, 64, generator=generator)
            loss = (model(x) - x @ target * 0.1).square().mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        results.append(
            {
                "config": (hook, wrapper, unused),
                "buckets": len(model.reducer._get_zeros_like_grad_buckets()),
                "params": flat.tolist(),
                "first_loss": losses[0],
                "last_loss": losses[-1],
            }
        )
    return results


def test_power_sgd_with_many_buckets_on_gloo() -> None:
    rank0, rank1 = run_distributed(train_many_buckets, nproc=2, timeout=180)
    blocking, _ = run_distributed(train_many_buckets, True, nproc=2, timeout=180)
    before = {result["config"]: result["params"] for result in blocking}
    assert len(before) == 3
    for a, b in zip(rank0, rank1, strict=True):
        assert a["config"] == b["config"]
        assert a["buckets"] > 1, a["config"]  # the case that hung
        assert a["params"] == b["params"], a["config"]  # ranks identical
        if a["config"] in before:
            assert a["params"] == before[a["config"]], a["config"]  # as the blocking hook's
        assert a["last_loss"] < a["first_loss"], a["config"]

"""PowerSGD with several DDP buckets on gloo trains to identical ranks (it used to hang: the
second all-reduce of a bucket, started from a gloo callback thread, raced with the next
bucket's first all-reduce)."""

from __future__ import annotations

from typing import Any

import torch

import kwplug
from kwplug.testing import run_distributed

CONFIGS = [
    ("power_sgd", "no"),
    ("batched_power_sgd", "no"),
    ("power_sgd", "bf16"),
    ("batched_power_sgd", "fp16"),
]


def train_many_buckets() -> list[dict[str, Any]]:
    """Runs on every rank: each config on a 6-layer MLP split into several small buckets."""
    results = []
    for hook, wrapper in CONFIGS:
        torch.manual_seed(0)
        handler = kwplug.DistributedDataParallelKwargs(
            comm_hook=hook,
            comm_wrapper=wrapper,
            bucket_cap_mb=0.02,  # ~20 kB: a bucket per layer or two
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
                "config": (hook, wrapper),
                "buckets": len(model.reducer._get_zeros_like_grad_buckets()),
                "params": flat.tolist(),
                "first_loss": losses[0],
                "last_loss": losses[-1],
            }
        )
    return results


def test_power_sgd_with_many_buckets_on_gloo() -> None:
    rank0, rank1 = run_distributed(train_many_buckets, nproc=2, timeout=180)
    for a, b in zip(rank0, rank1, strict=True):
        assert a["config"] == b["config"]
        assert a["buckets"] > 1, a["config"]  # the case that hung
        assert a["params"] == b["params"], a["config"]  # ranks identical
        assert a["last_loss"] < a["first_loss"], a["config"]

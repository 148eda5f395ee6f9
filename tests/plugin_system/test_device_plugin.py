"""A device torch does not report is a plugin (issue 29, item 4): the test plugin below,
:class:`EmulatedXLADevice`, answers ``select_device`` with a CPU-backed device under a
``distributed_type`` of its own (``XLA``: one device per process, as a TPU host reports it),
and the digits model trains on it in 1 and 2 processes (gloo, the built-in process-group
plugin's fallback for a device without NCCL), with no change to the core: the plugin is
defined here and passed in ``kwargs_handlers``.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import kwplug
from kwplug import KwargsHandler, hookimpl
from kwplug.hookspecs import DeviceChoice
from kwplug.testing import run_distributed

# Each select_device call of this process: (local_rank, world_size). Not a handler field:
# the ranks compare their handlers' fields at construction, and these differ by rank.
CHOSEN: list[tuple[int, int]] = []


@attrs.define
class EmulatedXLADevice(KwargsHandler):
    """The test plugin: one CPU-backed device per process, reported as ``XLA``."""

    @hookimpl
    def select_device(self, cpu: bool, local_rank: int, world_size: int) -> DeviceChoice | None:
        if cpu:  # Accelerator(cpu=True) / ACCELERATE_USE_CPU: not ours
            return None
        CHOSEN.append((local_rank, world_size))
        return DeviceChoice(torch.device("cpu"), distributed_type="XLA")


def train_digits(epochs: int = 8) -> dict[str, Any]:
    """Train a small MLP on scikit-learn's digits on the plugin's device; what a rank saw."""
    torch.manual_seed(0)
    accelerator = kwplug.Accelerator(kwargs_handlers=[EmulatedXLADevice()])
    images, labels = load_digits(return_X_y=True)
    data = TensorDataset(
        torch.tensor(images / 16.0, dtype=torch.float32), torch.tensor(labels, dtype=torch.long)
    )
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=64, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(epochs):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        x_all, y_all = data.tensors
        accuracy = float((model(x_all.to(accelerator.device)).argmax(1) == y_all).float().mean())
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    result = {
        "device": str(accelerator.device),
        "distributed_type": accelerator.distributed_type.value,
        "answered_by": accelerator.plan["select_device"].plugin,
        "chosen": CHOSEN,
        "wrapped": type(model).__name__,
        "accuracy": accuracy,
        "weights": weights.tolist(),
        "batches": len(loader),
    }
    if accelerator.num_processes > 1:
        result["backend"] = torch.distributed.get_backend()
    accelerator.end_training()
    return result


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_digits_model_trains_on_a_device_of_its_own(nproc: int) -> None:
    results = run_distributed(train_digits, nproc=nproc, timeout=300)
    assert len(results) == nproc
    for rank, result in enumerate(results):
        assert result["device"] == "cpu"
        assert result["distributed_type"] == "XLA"  # the plugin's, in 1 and 2 processes
        assert result["answered_by"].startswith("user[0]")
        assert result["chosen"] == [(rank, nproc)]
        assert result["accuracy"] > 0.9, result["accuracy"]
        assert result["batches"] == -(-1797 // (64 * nproc))  # the data sharded over the ranks
    if nproc == 2:
        # DDP over gloo (the built-in InitProcessGroupKwargs picks it for a device without
        # NCCL): both ranks end with the same weights.
        assert [r["backend"] for r in results] == ["gloo", "gloo"]
        assert [r["wrapped"] for r in results] == ["DistributedDataParallel"] * 2
        assert results[0]["weights"] == results[1]["weights"]

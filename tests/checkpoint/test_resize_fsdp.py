"""FSDP2 (kwplug-fsdp) checkpoints resumed on another number of processes: the full state
saved by 2 processes loads into 1 (and the other way round), weights and optimizer state
equal to what was saved, and training goes on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import kwplug
from kwplug.checkpoint import _sharded as sharded
from kwplug.testing import PluginSandbox, run_distributed

pytest.importorskip("kwplug_fsdp")


def setup() -> tuple[kwplug.Accelerator, nn.Module, torch.optim.Optimizer]:
    from kwplug_fsdp import FullyShardedKwargs

    accelerator = kwplug.Accelerator(
        cpu=True, kwargs_handlers=[FullyShardedKwargs(shard_modules=(nn.Linear,))]
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state by parameter name (rank 0; ``{}`` elsewhere when sharded)."""
    if sharded.is_sharded(model):
        weights = sharded.full_model_state(model)
        state = sharded.full_optimizer_state(model, optimizer).get("state", {})  # collective
    else:
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        names = [name for name, _ in model.named_parameters()]
        state = {names[i]: s for i, s in optimizer.state_dict()["state"].items()}
    tensors = {
        f"{name}.{key}": value.clone()
        for name, entry in state.items()
        for key, value in entry.items()
        if isinstance(value, torch.Tensor)
    }
    return {"model": weights, "optimizer": tensors}


def step(accelerator: kwplug.Accelerator, model: nn.Module, optimizer: Any) -> float:
    x = torch.linspace(-1, 1, 32).reshape(4, 8)
    loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.item())


def save(directory: str) -> dict[str, Any]:
    accelerator, model, optimizer = setup()
    for _ in range(3):
        step(accelerator, model, optimizer)
    accelerator.save_state(directory)
    result = {"sharded": sharded.is_sharded(model), **full_state(model, optimizer)}
    accelerator.end_training()
    return result


def load(directory: str) -> dict[str, Any]:
    accelerator, model, optimizer = setup()
    accelerator.load_state(directory)
    result = {"sharded": sharded.is_sharded(model), **full_state(model, optimizer)}
    result["loss"] = step(accelerator, model, optimizer)  # training goes on
    accelerator.end_training()
    return result


def assert_equal(saved: dict[str, Any], loaded: dict[str, Any]) -> None:
    for part in ("model", "optimizer"):
        assert saved[part].keys() == loaded[part].keys(), part
        for key, value in saved[part].items():
            assert torch.equal(value, loaded[part][key]), key


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_fsdp2_checkpoint_loads_at_another_size(tmp_path: Path, before: int, after: int) -> None:
    directory = str(tmp_path / "ckpt")
    with PluginSandbox(keep_installed=["kwplug-fsdp"]):
        saved = run_distributed(save, directory, nproc=before, timeout=120)
        loaded = run_distributed(load, directory, nproc=after, timeout=120)
    assert saved[0]["sharded"] is (before > 1) and loaded[0]["sharded"] is (after > 1)
    assert saved[0]["optimizer"]  # AdamW has state to compare
    assert_equal(saved[0], loaded[0])
    assert all(rank["loss"] == loaded[0]["loss"] for rank in loaded)

"""What the tracker tests share: an offline folder for the services' clients and a few real
training steps that log their loss."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import kwplug


@pytest.fixture
def offline_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tmp_path``, where offline wandb runs and Comet archives go (no account, no network)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("COMET_START_ONLINE", "false")
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path))
    monkeypatch.delenv("COMET_API_KEY", raising=False)
    return tmp_path


def _train(
    accelerator: kwplug.Accelerator,
    steps: int = 3,
    more: Callable[[int], Mapping[str, Any]] | None = None,
) -> list[float]:
    # A linear model's real SGD steps; each logs its loss as a 0-d tensor (trackers must turn
    # it into a number) plus more(step).
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    losses = []
    for step in range(1, steps + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.detach(), **(more(step) if more else {})}, step=step)
        losses.append(loss.item())
    return losses


@pytest.fixture
def train() -> Callable[..., list[float]]:
    """The training loop: ``train(accelerator, steps=3, more=lambda step: {...})`` prepares a
    linear model, runs ``steps`` SGD steps logging ``{"loss": ..., **more(step)}`` at steps
    1..steps and returns the losses."""
    return _train

"""A prepared schedule-free optimizer: ``train()``/``eval()`` reach the wrapped optimizer, as
through Accelerate's ``AcceleratedOptimizer``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kwplug

schedulefree = pytest.importorskip("schedulefree")


def _modes(accelerator: Any) -> list[Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = schedulefree.AdamWScheduleFree(model.parameters(), lr=0.1, warmup_steps=2)
    model, optimizer = accelerator.prepare(model, optimizer)
    seen: list[Any] = []
    for mode in ("train", "eval", "train"):
        getattr(optimizer, mode)()
        seen.append(optimizer.param_groups[0]["train_mode"])
        if mode == "train":
            model(torch.ones(2, 3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    optimizer.eval()  # evaluation weights: the averaged iterate
    seen.append(model.weight.detach().clone())
    return seen


def test_train_and_eval_reach_the_wrapped_optimizer_as_in_accelerate() -> None:
    from accelerate import Accelerator as AccelerateAccelerator

    ours = _modes(kwplug.Accelerator(cpu=True))
    theirs = _modes(AccelerateAccelerator(cpu=True))
    assert ours[:3] == theirs[:3] == [True, False, True]
    assert torch.equal(ours[3], theirs[3])

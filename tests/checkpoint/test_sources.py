"""The checkpoint package is given what it saves (``CheckpointSources``): it never sees the
Accelerator, imports nothing of ``kwplug.accelerator`` and the facade has no back door for it."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import kwplug
from kwplug import checkpoint
from kwplug.accelerator._gradient_state import GradientState
from kwplug.checkpoint import StatePreHooks
from kwplug.optimizer import AcceleratedOptimizer
from kwplug.utils.dataclasses import ProjectConfiguration

PACKAGE = Path(checkpoint.__file__).parent


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):  # TYPE_CHECKING blocks too
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


def test_checkpoint_package_imports_nothing_of_the_accelerator() -> None:
    found = {
        f"{path.name}: {name}"
        for path in sorted(PACKAGE.glob("*.py"))
        for name in _imports(path)
        if name == "kwplug.accelerator" or name.startswith("kwplug.accelerator.")
    }
    assert not found


def test_the_facade_has_no_back_door_for_checkpoints() -> None:
    # ``_models``, ``_optimizers`` and ``_dataloaders`` exist for code written for Accelerate
    # (which reads them); the checkpoint package never does: it gets its sources handed in.
    for path in sorted(PACKAGE.glob("*.py")):
        text = path.read_text()
        for name in ("._models", "._optimizers", "._scaled_optimizers", "._dataloaders"):
            assert name not in text, f"{path.name} reads {name}"
    accelerator = kwplug.Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    assert accelerator._models == [model]
    for name in ("_scaled_optimizers", "_custom_objects", "_call_each", "_call_with"):
        assert not hasattr(accelerator, name), name


def _sources(
    model: torch.nn.Module, optimizer: AcceleratedOptimizer, handlers: dict[str, Any]
) -> checkpoint.CheckpointSources:
    def load_handler_state(saved: Mapping[str, Any]) -> None:
        handlers.update(saved)

    counter = torch.optim.lr_scheduler.StepLR(optimizer.optimizer, 1)
    return checkpoint.CheckpointSources(
        models=(model,),
        optimizers=(optimizer,),
        dataloaders=(),
        custom_objects=(counter,),
        scaler=None,
        scaler_updates=None,
        gradient_state=GradientState(),
        pre_hooks=StatePreHooks(),
        process_index=0,
        num_processes=1,
        device=torch.device("cpu"),
        unwrap=lambda m: m,
        handler_state=lambda: dict(handlers),
        load_handler_state=load_handler_state,
        project_configuration=ProjectConfiguration(),
    )


def test_save_and_load_from_sources_alone(tmp_path: Path) -> None:
    # No Accelerator: a model, an Adam optimizer and a plugin's state, given as sources.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = AcceleratedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    handlers: dict[str, Any] = {"kwplug:test": {"calls": 3}}
    checkpoint.save_state(_sources(model, optimizer, handlers), tmp_path / "ckpt")
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_exp_avg = optimizer.optimizer.state[model.weight]["exp_avg"].clone()

    fresh = torch.nn.Linear(4, 3)
    fresh_optimizer = AcceleratedOptimizer(torch.optim.Adam(fresh.parameters(), lr=0.1))
    restored: dict[str, Any] = {}
    checkpoint.load_state(_sources(fresh, fresh_optimizer, restored), tmp_path / "ckpt")
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, saved_model[name]), name
    assert torch.equal(fresh_optimizer.optimizer.state[fresh.weight]["exp_avg"], saved_exp_avg)
    assert restored == {"kwplug:test": {"calls": 3}}


def test_sources_are_frozen_and_built_per_call() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    first = accelerator._checkpoint_sources()
    assert first.models == (model,) and first.is_main_process
    accelerator.register_for_checkpointing(
        torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    )
    assert first.custom_objects == ()  # a snapshot: the next call sees the new object
    assert len(accelerator._checkpoint_sources().custom_objects) == 1
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        first.models = ()  # type: ignore[misc]

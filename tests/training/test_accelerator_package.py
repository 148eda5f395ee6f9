"""The ``kwplug.accelerator`` package: one frozen setup resolved at construction, a registry of
prepared objects, and a facade that delegates to them."""

from __future__ import annotations

import logging
from typing import Any

import attrs
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import kwplug
import kwplug.accelerator
from kwplug import KwargsHandler, hookimpl
from kwplug.accelerator._setup import _Setup


@attrs.define
class CountingHandler(KwargsHandler):
    """Answers the set-up hooks ``autocast`` and ``make_scaler`` and counts the calls."""

    calls: list[str] = attrs.field(factory=list)

    @hookimpl
    def autocast(self, device_type: str) -> Any:
        self.calls.append("autocast")
        return lambda: torch.autocast(device_type, dtype=torch.bfloat16)

    @hookimpl
    def make_scaler(self) -> None:
        self.calls.append("make_scaler")


def test_public_import_paths_name_one_class() -> None:
    assert kwplug.Accelerator is kwplug.accelerator.Accelerator
    assert kwplug.accelerator.Accelerator.__module__ == "kwplug.accelerator"
    assert kwplug.accelerator.MIXED_PRECISION == ("no", "fp16", "bf16")


def test_setup_is_resolved_once_and_frozen() -> None:
    handler = CountingHandler()
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])
    assert handler.calls == ["autocast", "make_scaler"]
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    for _ in range(3):
        with accelerator.autocast():
            accelerator.backward(model(torch.ones(1, 2)).sum())
    assert handler.calls == ["autocast", "make_scaler"]  # no hook per step
    setup = accelerator._setup
    assert isinstance(setup, _Setup)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setup.device = torch.device("meta")  # type: ignore[misc]
    assert (accelerator.device, accelerator.scaler) == (setup.device, setup.scaler)
    assert accelerator.plugin_manager is setup.plugins
    assert accelerator.handlers == [handler]


def test_prepare_records_into_the_plan_not_into_the_setup() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    # the set-up hooks, answered once: the device, the mesh, autocast and the scaler
    assert set(accelerator._setup.answers) == {
        "select_device", "device_mesh", "autocast", "make_scaler"
    }  # fmt: skip
    accelerator.prepare(torch.nn.Linear(2, 2))
    assert "wrap_model" in accelerator.plan
    assert "wrap_model" not in accelerator._setup.answers
    # A per-call handler answers for that call only and replaces no recorded answer.
    before = accelerator.plan["autocast"]
    with accelerator.autocast(CountingHandler()):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert accelerator.plan["autocast"] is before
    with accelerator.profile():
        pass
    assert accelerator.plan["make_profiler"].plugin == "kwplug:profile"


def test_registry_is_per_accelerator_and_cleared_by_end_training() -> None:
    first = kwplug.Accelerator(cpu=True, mixed_precision="fp16")
    second = kwplug.Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2)
    model, optimizer, loader = first.prepare(model, optimizer, loader)
    first.register_for_checkpointing(torch.optim.lr_scheduler.StepLR(optimizer, 1))
    assert first._prepared.models == [model] and first._prepared.optimizers == [optimizer]
    assert first._prepared.scaled_optimizers == [optimizer] and first._prepared.dataloaders == [
        loader
    ]
    assert len(first._prepared.custom_objects) == 1
    assert second._prepared.models == [] and second._prepared.optimizers == []
    first.end_training()
    assert (
        first._prepared.models,
        first._prepared.optimizers,
        first._prepared.scaled_optimizers,
    ) == ([], [], [])
    assert (first._prepared.dataloaders, first._prepared.custom_objects) == ([], [])


def test_setup_logs_under_the_package_logger(caplog: pytest.LogCaptureFixture) -> None:
    # Who answered each hook is logged by the manager (KWPLUG_TRACE_PLUGINS, "kwplug.trace").
    with caplog.at_level(logging.DEBUG, logger="kwplug.accelerator"):
        kwplug.Accelerator(cpu=True)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("Accelerator on cpu, rank 0/1") for m in messages)

"""The ``select_device`` hook: a plugin's answer is the Accelerator's device and
``distributed_type``; ``None`` falls through; without an answer the built-in choice applies;
a bad answer is refused naming the plugin."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

import kwplug
from kwplug import KwargsHandler, hookimpl
from kwplug.hookspecs import DeviceChoice
from kwplug.state import PartialState
from kwplug.utils import DistributedType


@attrs.define
class _Fixed(KwargsHandler):
    """Answers ``select_device`` with ``answer`` and records what it was asked."""

    answer: Any = None
    asked: list[tuple[bool, int, int]] = attrs.field(factory=list)

    @hookimpl
    def select_device(self, cpu: bool, local_rank: int, world_size: int) -> Any:
        self.asked.append((cpu, local_rank, world_size))
        return self.answer


@attrs.define
class _Other(_Fixed):
    pass


def test_hook_select_device() -> None:
    plugin = _Fixed(DeviceChoice(torch.device("cpu", 0), distributed_type="MULTI_CPU"))
    accelerator = kwplug.Accelerator(kwargs_handlers=[plugin])
    assert plugin.asked == [(False, 0, 1)]
    assert accelerator.device == torch.device("cpu", 0)
    # The declared type is reported, even in one process (as Accelerate reports XLA on 1 TPU).
    assert accelerator.distributed_type is DistributedType.MULTI_CPU
    assert accelerator.plan["select_device"].plugin.startswith("user[0]")
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    assert next(model.parameters()).device == torch.device("cpu")


def test_hook_select_device_none_falls_through_to_the_next_plugin() -> None:
    first, second = _Fixed(None), _Other(DeviceChoice(torch.device("cpu")))
    accelerator = kwplug.Accelerator(kwargs_handlers=[first, second])
    assert first.asked == second.asked == [(False, 0, 1)]
    assert accelerator.plan["select_device"].plugin.startswith("user[1]")
    assert accelerator.distributed_type is DistributedType.NO  # None: the default mapping


def test_hook_select_device_without_an_answer_is_the_built_in_choice(monkeypatch: Any) -> None:
    plugin = _Fixed(None)
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[plugin])
    assert accelerator.device == torch.device("cpu")
    assert accelerator.plan["select_device"].plugin is None
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    kwplug.Accelerator(kwargs_handlers=[plugin])
    assert plugin.asked == [(True, 0, 1), (True, 0, 1)]  # the forced CPU reaches the plugin


def test_hook_select_device_user_handler_answers_before_a_default() -> None:
    # No default plugin answers today; a user handler's answer is the first asked.
    plugin = _Fixed(DeviceChoice(torch.device("cpu")))
    accelerator = kwplug.Accelerator(kwargs_handlers=[plugin])
    assert accelerator.plan["select_device"].asked[0].startswith("user[0]")


def test_select_device_answer_is_checked() -> None:
    with pytest.raises(TypeError, match=r"select_device of .*DeviceChoice or None, got device"):
        kwplug.Accelerator(kwargs_handlers=[_Fixed(torch.device("cpu"))])
    with pytest.raises(ValueError, match=r"distributed_type must be one of .*'MULTI_CPU'.*'TPU'"):
        kwplug.Accelerator(kwargs_handlers=[_Fixed(DeviceChoice(torch.device("cpu"), "TPU"))])
    with pytest.raises(TypeError, match="DeviceChoice.device must be a torch.device"):
        DeviceChoice("cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="distributed_type"):
        DeviceChoice(torch.device("cpu"), 3)  # type: ignore[arg-type]


_ASKED: list[int] = []


@attrs.define
class InstalledDevice(KwargsHandler):
    """A default plugin (installed in the sandbox) choosing ``cpu:0`` as ``MULTI_CPU``."""

    @hookimpl
    def select_device(self, local_rank: int) -> DeviceChoice:
        _ASKED.append(local_rank)
        return DeviceChoice(torch.device("cpu", 0), distributed_type="MULTI_CPU")


def test_partial_state_asks_the_hook(kwplug_plugins: Any) -> None:
    kwplug_plugins.add(InstalledDevice)
    state = PartialState()
    assert state.device == torch.device("cpu", 0)
    assert state.distributed_type is DistributedType.MULTI_CPU
    assert _ASKED == [0]
    # A user handler answers before the installed default.
    accelerator = kwplug.Accelerator(kwargs_handlers=[_Fixed(DeviceChoice(torch.device("cpu")))])
    assert accelerator.plan["select_device"].plugin.startswith("user[0]")
    assert _ASKED == [0]

"""A repeated built-in-only construction replays the set-up hooks' answers: same result as a
fresh one, and anything that could change the outcome is seen (issue 31, goal 3)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch

import kwplug
from kwplug import AutocastKwargs, KwargsHandler, hookimpl
from kwplug._plugins import _reuse
from kwplug.accelerator import _setup_cache
from kwplug.hookspecs import DeviceChoice
from kwplug.testing import PluginSandbox


@attrs.define
class CpuChooser(KwargsHandler):
    """A plugin answering ``select_device``: a third-party answer, never replayed."""

    @hookimpl
    def select_device(self, cpu: bool, local_rank: int, world_size: int) -> DeviceChoice:
        return DeviceChoice(torch.device("cpu"))


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The ``mixed_precision`` of each built-in ``autocast`` hook call; the caches are empty
    before and after."""
    seen: list[str] = []
    real = AutocastKwargs.autocast

    def counting(self: AutocastKwargs, device_type: str, mixed_precision: str) -> Any:
        seen.append(mixed_precision)
        return real(self, device_type, mixed_precision)

    _setup_cache.clear()
    _reuse.clear()  # templates re-bind the class's function as it was when they were made
    monkeypatch.setattr(AutocastKwargs, "autocast", hookimpl(counting))
    yield seen
    _setup_cache.clear()
    _reuse.clear()


def factory(made: Any) -> Any:
    """An autocast factory as plain values (a ``functools.partial`` equals only itself)."""
    return (made.func, made.args, made.keywords) if isinstance(made, functools.partial) else made


def summary(accelerator: kwplug.Accelerator) -> list[Any]:
    """Everything the set-up hooks decide, as plain values."""
    setup = accelerator._setup
    return [
        {
            name: (a.hook, factory(a.result), a.plugin, a.asked)
            for name, a in accelerator.plan.items()
        },
        list(accelerator.plan),
        accelerator.device,
        setup.chosen,
        setup.process,
        sorted(setup.comm_hooks),
        factory(setup.autocast_factory),
        setup.scaler,
        setup.device_mesh,
        setup.data_parallel,
        accelerator.mixed_precision,
    ]


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_a_replayed_construction_equals_a_fresh_one(calls: list[str], precision: str) -> None:
    fresh = kwplug.Accelerator(mixed_precision=precision, cpu=True)
    replayed = kwplug.Accelerator(mixed_precision=precision, cpu=True)
    assert calls == [precision]  # the second one asked no hook
    assert summary(replayed) == summary(fresh)
    assert replayed.plugin_manager is not fresh.plugin_manager
    assert replayed.plan is not fresh.plan and replayed.comm_hooks is not fresh.comm_hooks
    _setup_cache.clear()
    assert summary(kwplug.Accelerator(mixed_precision=precision, cpu=True)) == summary(fresh)
    assert calls == [precision, precision]


def test_the_arguments_are_part_of_the_key(calls: list[str]) -> None:
    kwplug.Accelerator(cpu=True)
    kwplug.Accelerator(mixed_precision="bf16", cpu=True)
    kwplug.Accelerator(cpu=False)
    assert calls == ["no", "bf16", "no"]


def test_built_in_handlers_are_keyed_by_their_values(calls: list[str]) -> None:
    handler = AutocastKwargs()
    kwplug.Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[handler])
    again = kwplug.Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[handler])
    assert calls == ["bf16"]
    assert again.handlers == [handler] and again.handlers[0] is handler
    handler.enabled = False  # the same object, changed: asked again
    off = kwplug.Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[handler])
    assert calls == ["bf16", "bf16"]
    with off.autocast():
        assert not torch.is_autocast_enabled("cpu")
    kwplug.Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[AutocastKwargs()])
    assert calls == ["bf16", "bf16"]  # equal values: replayed


def test_a_handler_has_one_key_from_its_first_construction_on() -> None:
    # The first snapshot of a value type learns it as plain; the key it gives must be the
    # one later constructions compute, or the first construction's entry is never replayed.
    _setup_cache.clear()
    try:
        first = _setup_cache.key("bf16", True, [AutocastKwargs()], ())
        assert first == _setup_cache.key("bf16", True, [AutocastKwargs()], ())
        assert first != _setup_cache.key("bf16", True, [AutocastKwargs(enabled=False)], ())
    finally:
        _setup_cache.clear()


def test_a_handler_of_another_class_is_never_replayed(calls: list[str]) -> None:
    for _ in range(2):
        accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[CpuChooser()])
        assert accelerator.plan["select_device"].plugin is not None
    assert _setup_cache.key("no", True, [CpuChooser()], ()) is None
    assert calls == ["no", "no"]


def test_a_key_tells_one_from_true_and_a_list_from_a_tuple() -> None:
    @attrs.define
    class Holder(KwargsHandler):
        value: Any = None

    Holder.__module__ = "kwplug.plugins.example"  # as a built-in class
    keys = {_setup_cache.key("no", True, [Holder(v)], ()) for v in (1, True, [1], (1,), {1: 1})}
    assert len(keys) == 5 and None not in keys
    assert _setup_cache.key("no", True, [Holder(object())], ()) is None


def test_a_changed_environment_variable_is_seen(
    calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    kwplug.Accelerator()
    monkeypatch.setenv("ACCELERATE_USE_CPU", "maybe")  # read by the device choice
    with pytest.raises(ValueError, match="maybe"):
        kwplug.Accelerator()
    monkeypatch.setenv("KWPLUG_UNRELATED", "1")  # any change: the hooks are asked again
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    kwplug.Accelerator()
    assert calls == ["no", "no"]  # the failing construction stopped before the autocast hook


def test_a_blocked_plugin_is_seen(calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert kwplug.Accelerator(cpu=True).plan["autocast"].plugin == "kwplug:autocast"
    monkeypatch.setenv("KWPLUG_BLOCK_PLUGINS", "kwplug:autocast")
    assert kwplug.Accelerator(cpu=True).plan["autocast"].plugin is None
    monkeypatch.delenv("KWPLUG_BLOCK_PLUGINS")
    assert kwplug.Accelerator(cpu=True).plan["autocast"].plugin == "kwplug:autocast"


def test_a_newly_installed_plugin_is_seen(calls: list[str], kwplug_plugins: PluginSandbox) -> None:
    kwplug.Accelerator(cpu=True)
    kwplug.Accelerator(cpu=True)
    assert kwplug.Accelerator(cpu=True).plan["select_device"].plugin is None
    kwplug_plugins.add(CpuChooser, name="chooser", distribution="kwplug-chooser")
    for _ in range(2):  # a third-party set-up answer is asked for every time
        chosen = kwplug.Accelerator(cpu=True).plan["select_device"].plugin
        assert chosen is not None and "chooser" in chosen
    assert calls == ["no", "no", "no"]


def test_tracing_sees_every_hook_call(
    calls: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    kwplug.Accelerator(cpu=True)
    monkeypatch.setenv("KWPLUG_TRACE_PLUGINS", "1")
    with caplog.at_level(logging.INFO, logger="kwplug.trace"):
        kwplug.Accelerator(cpu=True)
        kwplug.Accelerator(cpu=True)
    assert calls == ["no", "no", "no"]
    asked = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hook autocast")]
    assert len(asked) >= 2


def test_a_loss_scaler_is_never_shared(calls: list[str]) -> None:
    first = kwplug.Accelerator(mixed_precision="fp16", cpu=True)
    second = kwplug.Accelerator(mixed_precision="fp16", cpu=True)
    assert first.scaler is not None and second.scaler is not first.scaler
    assert calls == ["fp16", "fp16"]

"""Repeated Accelerator construction copies a template manager: same result, no shared state."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch

import kwplug
from kwplug import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    KwargsHandler,
    hookimpl,
)
from kwplug._plugins import KwplugPluginManager, _reuse, discover


@attrs.define
class CountingAutocast(KwargsHandler):
    calls: list[str] = attrs.field(factory=list)

    @hookimpl
    def autocast(self, device_type: str) -> None:
        self.calls.append(device_type)


@attrs.define
class StaticAutocast(KwargsHandler):
    @hookimpl
    @staticmethod
    def autocast(device_type: str) -> None:
        return None


def layout(pm: KwplugPluginManager) -> list[Any]:
    """Everything registration decides, plugin objects by name."""
    hooks = {
        name: [
            (i.plugin_name, i.argnames, i.kwargnames, i.opts, i.plugin)
            for i in caller.get_hookimpls()
        ]
        for name, caller in sorted(vars(pm.hook).items())
    }
    for caller in vars(pm.hook).values():  # each implementation is bound to its own object
        for impl in caller.get_hookimpls():
            assert pm.get_plugin(impl.plugin_name) is impl.plugin
            assert getattr(impl.function, "__self__", impl.plugin) is impl.plugin
    return [
        [(n, pm.describe(n), pm.is_third_party(n)) for n, _ in pm.list_name_plugin()],
        {h: [(n, a, k, o, type(p)) for n, a, k, o, p in impls] for h, impls in hooks.items()},
        {
            name: (s.namespace, s.argnames, s.kwargnames, s.opts) if s else None
            for name, caller in vars(pm.hook).items()
            for s in [caller.spec]
        },
    ]


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts full (pluggy) builds of a manager; templates are forgotten before and after."""
    count: list[int] = []
    real = KwplugPluginManager.for_handlers.__func__  # type: ignore[attr-defined]

    def counting(cls: Any, *args: Any) -> Any:
        count.append(1)
        return real(cls, *args)

    _reuse.clear()
    monkeypatch.setattr(KwplugPluginManager, "for_handlers", classmethod(counting))
    yield count
    _reuse.clear()


@pytest.mark.parametrize(
    "make",
    [
        list,
        lambda: [AutocastKwargs(), DistributedDataParallelKwargs(), GradScalerKwargs()],
        lambda: [CountingAutocast(), GradScalerKwargs()],
    ],
)
def test_a_copied_manager_equals_a_fresh_build(make: Any, builds: list[int]) -> None:
    records = discover()
    first = _reuse.manager_for(make(), records)
    handlers = make()
    copied = _reuse.manager_for(handlers, records)
    assert len(builds) == 1
    assert (
        layout(copied)
        == layout(first)
        == layout(KwplugPluginManager.for_handlers(handlers, records))
    )
    registered = dict(copied.list_name_plugin())
    for handler in handlers:  # the user's own objects, not equal copies
        assert any(p is handler for p in registered.values())
    for name, plugin in first.list_name_plugin():  # fresh default instances per manager
        if isinstance(plugin, KwargsHandler):
            assert registered[name] is not plugin


def test_reuse_only_for_the_same_handler_classes_and_controls(
    builds: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    kwplug.Accelerator(cpu=True, kwargs_handlers=[AutocastKwargs()])
    kwplug.Accelerator(cpu=True, kwargs_handlers=[AutocastKwargs(enabled=False)])  # same class
    assert len(builds) == 1
    kwplug.Accelerator(cpu=True, kwargs_handlers=[GradScalerKwargs()])
    kwplug.Accelerator(cpu=True, kwargs_handlers=[AutocastKwargs(), GradScalerKwargs()])
    kwplug.Accelerator(cpu=True, kwargs_handlers=[GradScalerKwargs(), AutocastKwargs()])
    assert len(builds) == 4
    monkeypatch.setenv("KWPLUG_BLOCK_PLUGINS", "kwplug:profile")
    blocked = kwplug.Accelerator(cpu=True, kwargs_handlers=[AutocastKwargs()])
    assert len(builds) == 5
    assert blocked.plugin_manager.get_plugin("kwplug:profile") is None
    monkeypatch.delenv("KWPLUG_BLOCK_PLUGINS")
    again = kwplug.Accelerator(cpu=True, kwargs_handlers=[AutocastKwargs()])
    assert len(builds) == 5 and again.plugin_manager.get_plugin("kwplug:profile") is not None


def test_hooks_are_called_on_each_accelerators_own_handler(builds: list[int]) -> None:
    first, second = CountingAutocast(), CountingAutocast()
    kwplug.Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[first])
    kwplug.Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[second])
    assert len(builds) == 1 and first.calls == ["cpu"] and second.calls == ["cpu"]


def test_no_state_is_shared_between_accelerators(builds: list[int]) -> None:
    a = kwplug.Accelerator(mixed_precision="fp16", cpu=True)
    b = kwplug.Accelerator(mixed_precision="fp16", cpu=True)
    assert len(builds) == 1
    assert a.scaler is not None and b.scaler is not None and a.scaler is not b.scaler
    assert a.plugin_manager is not b.plugin_manager and a.plan is not b.plan
    a.prepare(torch.nn.Linear(2, 2))
    assert "wrap_model" in a.plan and "wrap_model" not in b.plan
    a.plugin_manager.unregister(name="kwplug:autocast")  # one Accelerator's own business
    for other in (b, kwplug.Accelerator(mixed_precision="fp16", cpu=True)):
        assert other.plugin_manager.get_plugin("kwplug:autocast") is not None
        assert other.plan["autocast"].plugin == "kwplug:autocast"


def test_static_method_hooks_are_built_every_time(builds: list[int]) -> None:
    for _ in range(2):
        accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[StaticAutocast()])
        assert accelerator.plan["autocast"].plugin is not None
    assert len(builds) == 2  # no template: its implementation cannot be re-bound

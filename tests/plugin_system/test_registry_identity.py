"""An Accelerator's plugin manager answers pluggy's registry questions by identity.

Handlers compare by value and do not hash (as Accelerate's dataclass handlers), so pluggy's own
``get_plugins()`` raised ``TypeError: unhashable type``, ``is_registered``/``get_name`` called
an equal copy registered, ``register`` refused a second, equal handler and
``subset_hook_caller`` raised. Each test below failed before ``kwplug._plugins._identity``.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import pytest
import torch

import kwplug
from kwplug import KwargsHandler, hookimpl
from kwplug._plugins import _reuse
from kwplug._plugins._identity import PluginSet
from kwplug.utils import AutocastKwargs, DistributedDataParallelKwargs


@attrs.define
class RecordingAutocast(KwargsHandler):
    """Answers autocast for any device with float16 and records each call."""

    calls: list[str] = attrs.field(factory=list)

    @hookimpl
    def autocast(self, device_type: str) -> Any:
        self.calls.append(device_type)
        return functools.partial(torch.autocast, device_type, dtype=torch.float16)


@pytest.mark.parametrize("build", ["first", "copied"])
def test_get_plugins_holds_every_registered_object(build: str) -> None:
    # "copied": the manager is filled from the template the first construction left
    # (kwplug._plugins._reuse); "first": built the pluggy way (clear() forgets templates).
    handlers = [DistributedDataParallelKwargs()]
    kwplug.Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs()])
    if build == "first":
        _reuse.clear()
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=handlers)
    pm = accelerator.plugin_manager
    plugins = pm.get_plugins()
    registered = [obj for _, obj in pm.list_name_plugin() if obj is not None]
    assert len(plugins) == len(registered) > 5
    assert all(obj in plugins for obj in registered)
    assert list(plugins) == registered  # registration order
    # An equal (by value) handler that is not registered is not in it.
    assert DistributedDataParallelKwargs() not in plugins
    assert any(isinstance(obj, DistributedDataParallelKwargs) for obj in plugins)


def test_set_operators_work_on_unhashable_handlers() -> None:
    pm = kwplug.Accelerator(cpu=True).plugin_manager
    plugins = pm.get_plugins()
    modules = PluginSet(p for p in plugins if not isinstance(p, KwargsHandler))
    handlers = plugins - modules
    assert handlers and all(isinstance(h, KwargsHandler) for h in handlers)
    assert handlers | modules == plugins
    assert handlers <= plugins and not plugins <= handlers
    assert not (handlers & modules)
    with pytest.raises(TypeError):
        hash(plugins)


def test_equal_copy_is_not_registered() -> None:
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[AutocastKwargs()])
    pm = accelerator.plugin_manager
    user_name, user_handler = next(
        (n, o) for n, o in pm.list_name_plugin() if n.startswith("user[0]")
    )
    copy = AutocastKwargs()
    assert copy == user_handler and copy is not user_handler
    assert pm.is_registered(user_handler) and pm.get_name(user_handler) == user_name
    assert not pm.is_registered(copy)
    assert pm.get_name(copy) is None
    assert pm.get_hookcallers(copy) is None


def test_equal_handlers_register_and_unregister_separately() -> None:
    first = RecordingAutocast()
    accelerator = kwplug.Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[first])
    pm = accelerator.plugin_manager
    first.calls.clear()  # the Accelerator asked it once at construction
    second = RecordingAutocast()
    assert second == first
    assert pm.register(second, name="second") == "second"
    with pytest.raises(ValueError, match="already registered"):
        pm.register(second, name="again")  # the same object twice is still refused
    # One-answer hook: pluggy asks the last registered first, so the second one answers.
    assert pm.hook.autocast(device_type="cpu", mixed_precision="bf16") is not None
    assert second.calls == ["cpu"] and first.calls == []
    assert pm.unregister(second) is second
    assert pm.is_registered(first) and not pm.is_registered(second)
    pm.hook.autocast(device_type="cpu", mixed_precision="bf16")
    assert first.calls == ["cpu"] and second.calls == ["cpu"]


def test_subset_hook_caller_leaves_out_an_unhashable_handler() -> None:
    handler = RecordingAutocast()
    accelerator = kwplug.Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[handler])
    pm = accelerator.plugin_manager
    seen: list[list[str]] = []
    undo = pm.add_hookcall_monitoring(
        lambda hook, impls, kwargs: seen.append([i.plugin_name for i in impls]),
        lambda outcome, hook, impls, kwargs: None,
    )
    try:
        subset = pm.subset_hook_caller("autocast", remove_plugins=[handler, RecordingAutocast()])
        assert subset(device_type="cpu", mixed_precision="bf16") is not None
    finally:
        undo()
    assert handler.calls == ["cpu"]  # asked once, at construction
    assert seen and not any(name.startswith("user[0]") for name in seen[-1])
    assert seen[-1]  # the built-in autocast plugin was still asked
    # Nothing to leave out (an equal copy is not the registered handler): the hook itself.
    assert pm.subset_hook_caller("autocast", [RecordingAutocast()]) is pm.hook.autocast
    pm.hook.autocast(device_type="cpu", mixed_precision="bf16")
    assert handler.calls == ["cpu", "cpu"]

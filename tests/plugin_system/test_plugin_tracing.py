"""pluggy's own monitoring (``enable_tracing``, ``add_hookcall_monitoring``) and
``KWPLUG_TRACE_PLUGINS`` see every hook call kwplug makes, and who answered."""

from __future__ import annotations

import logging
import pickle
from collections.abc import Sequence
from typing import Any

import attrs
import pluggy
import pytest

from kwplug import Accelerator, AutocastKwargs, KwargsHandler, hookimpl
from kwplug._plugins import KwplugPluginManager
from kwplug.errors import PluginHookError
from kwplug.hookspecs import HOOKS
from kwplug.testing import PluginSandbox

# The hooks a one-process Accelerator() calls, in order (init_process_group needs WORLD_SIZE > 1).
SETUP_HOOKS = [
    "select_device",
    "comm_hooks",
    "validate_setup",
    "device_mesh",
    "autocast",
    "make_scaler",
]


@attrs.define
class BrokenScaler(KwargsHandler):
    @hookimpl
    def make_scaler(self) -> None:
        raise ValueError("scaler broke")


class Monitor:
    """Installs pluggy's tracing and monitoring on every manager an Accelerator builds."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.results: list[tuple[str, Any]] = []
        self.trace: list[str] = []
        build = KwplugPluginManager.for_handlers.__func__  # type: ignore[attr-defined]

        def for_handlers(cls: type[KwplugPluginManager], *args: Any) -> KwplugPluginManager:
            pm: KwplugPluginManager = build(cls, *args)
            pm.trace.root.setwriter(self.trace.append)
            pm.enable_tracing()
            pm.add_hookcall_monitoring(self.before, self.after)
            return pm

        monkeypatch.setattr(KwplugPluginManager, "for_handlers", classmethod(for_handlers))

    def before(self, hook: str, impls: Sequence[pluggy.HookImpl], kwargs: Any) -> None:
        self.calls.append((hook, [i.plugin_name for i in reversed(impls)]))

    def after(self, outcome: pluggy.Result[Any], hook: str, impls: Any, kwargs: Any) -> None:
        result = outcome.exception if outcome.exception is not None else outcome.get_result()
        self.results.append((hook, result))


def test_monitoring_sees_every_setup_hook_call_and_who_answered(
    kwplug_plugins: PluginSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monitor = Monitor(monkeypatch)
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    assert [hook for hook, _ in monitor.calls] == SETUP_HOOKS
    assert set(SETUP_HOOKS) <= set(HOOKS)
    asked = dict(monitor.calls)
    answers = dict(monitor.results)
    for hook in ("autocast", "make_scaler"):
        answer = accelerator.plan[hook]
        assert answer.plugin is not None and answer.plugin in asked[hook]
        assert answers[hook] is answer.result  # pluggy saw the very answer kwplug recorded
    assert accelerator.plan["make_scaler"].plugin == "kwplug:grad_scaler"
    assert "kwplug:ddp_comm_hooks" in asked["comm_hooks"]
    assert "kwplug:ddp" in asked["validate_setup"]
    text = "".join(monitor.trace)
    assert all(f"{hook} [hook]" in text for hook in SETUP_HOOKS), text
    assert "finish autocast -->" in text


def test_monitoring_sees_per_call_handlers_and_errors(
    kwplug_plugins: PluginSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monitor = Monitor(monkeypatch)
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    monitor.calls.clear()
    with accelerator.autocast(AutocastKwargs(enabled=False)):
        pass
    assert monitor.calls == [("autocast", ["<per-call handler>", "kwplug:autocast"])]

    kwplug_plugins.add(BrokenScaler, name="broken", distribution="kwplug-broken", version="2.0")
    monitor.results.clear()
    with pytest.raises(PluginHookError, match="hook 'make_scaler' of default plugin 'broken'"):
        Accelerator(cpu=True)
    hook, error = monitor.results[-1]
    assert hook == "make_scaler" and isinstance(error, PluginHookError)
    assert (error.plugin, error.hook) == ("kwplug-broken:broken", "make_scaler")
    assert isinstance(error.__cause__, ValueError)
    copied = pickle.loads(pickle.dumps(error))
    assert (copied.plugin, copied.hook, str(copied)) == (error.plugin, error.hook, str(error))


def test_kwplug_trace_plugins_logs_every_call_and_who_answered(
    kwplug_plugins: PluginSandbox,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("KWPLUG_TRACE_PLUGINS", "1")
    with caplog.at_level(logging.INFO, logger="kwplug.trace"):
        accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    messages = [r.getMessage() for r in caplog.records if r.name == "kwplug.trace"]
    for hook in SETUP_HOOKS:
        assert any(m.startswith(f"hook {hook}(") for m in messages), (hook, messages)
    autocast = accelerator.plan["autocast"]
    who = accelerator.plugin_manager.describe(autocast.plugin or "")
    assert f"hook autocast answered by {who}: {autocast.result!r}" in messages
    assert any(m.startswith("hook make_scaler answered by default plugin") for m in messages)


def test_no_trace_without_the_variable(
    kwplug_plugins: PluginSandbox, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kwplug.trace"):
        Accelerator(cpu=True)
    assert not [r for r in caplog.records if r.name == "kwplug.trace"]


def test_watched_follows_monitoring_and_tracing() -> None:
    # The manager knows when a hook call must go through pluggy's _hookexec (so that the
    # monitor sees it) from its own count, not from pluggy's private executor.
    pm = KwplugPluginManager()
    pm.register_plugin(AutocastKwargs(), "kwplug:autocast", "the built-in")
    seen: list[str] = []
    trace: list[str] = []
    pm.trace.root.setwriter(trace.append)
    assert not pm.watched
    undo = pm.add_hookcall_monitoring(lambda hook, *_: seen.append(hook), lambda *_: None)
    undo_tracing = pm.enable_tracing()
    assert pm.watched
    pm.first.autocast(device_type="cpu", mixed_precision="bf16")
    assert seen == ["autocast"]
    assert "autocast [hook]" in "".join(trace)
    undo_tracing()  # pluggy's undo functions run last-in first-out
    assert pm.watched  # the monitor is still on
    pm.first.autocast(device_type="cpu", mixed_precision="bf16")
    assert seen == ["autocast", "autocast"]
    undo()
    undo()  # a second undo changes nothing
    assert not pm.watched
    assert pm.first.autocast(device_type="cpu", mixed_precision="bf16") is not None
    assert seen == ["autocast", "autocast"]
    assert pm.plan["autocast"].plugin == "kwplug:autocast"

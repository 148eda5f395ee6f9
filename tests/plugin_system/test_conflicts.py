"""Conflict policy per hook: two third-party defaults claiming one device are an error."""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import attrs
import pytest
import torch

from kwplug import Accelerator, KwargsHandler, hookimpl
from kwplug.errors import PluginConflictError
from kwplug.hookspecs import HOOK_POLICY, HOOKS, ONE_ANSWER, HandlerSpec
from kwplug.testing import PluginSandbox, conformance_problems


@attrs.define
class AutocastA(KwargsHandler):
    @hookimpl
    def autocast(self, device_type: str) -> Any:
        return functools.partial(torch.autocast, device_type, dtype=torch.bfloat16)


@attrs.define
class AutocastB(KwargsHandler):
    @hookimpl
    def autocast(self, device_type: str) -> Any:
        return functools.partial(torch.autocast, device_type, dtype=torch.float16)


@attrs.define
class AutocastXpuOnly(KwargsHandler):
    device_types: ClassVar[frozenset[str] | None] = frozenset({"xpu"})

    @hookimpl
    def autocast(self, device_type: str) -> Any:
        return functools.partial(torch.autocast, device_type, dtype=torch.float16)


@attrs.define
class AutocastFallback(KwargsHandler):
    @hookimpl(trylast=True)
    def autocast(self, device_type: str) -> Any:
        return functools.partial(torch.autocast, device_type, dtype=torch.float16)


@attrs.define
class BadDeviceTypes(KwargsHandler):
    device_types: ClassVar[Any] = "cuda"  # a str, not a collection of them

    @hookimpl
    def autocast(self) -> None:
        return None


def test_every_hook_spec_declares_a_conflict_policy() -> None:
    specs = {name for name in dir(HandlerSpec) if not name.startswith("_")}
    assert set(HOOKS) == set(HOOK_POLICY) == specs
    for name, info in HOOKS.items():
        firstresult = getattr(HandlerSpec, name).kwplug_spec["firstresult"]
        assert (info.policy == ONE_ANSWER) is firstresult is info.firstresult, name
        assert HOOK_POLICY[name] == info.policy


def test_two_defaults_claiming_one_hook_raise_one_error_naming_both(
    kwplug_plugins: PluginSandbox,
) -> None:
    kwplug_plugins.add(AutocastA, name="amp-a", distribution="kwplug-amp-a", version="1.2")
    kwplug_plugins.add(AutocastB, name="amp-b", distribution="kwplug-amp-b", version="3.4")
    with pytest.raises(PluginConflictError) as info:
        Accelerator(mixed_precision="bf16")
    message = str(info.value)
    assert "'autocast'" in message and "'cpu'" in message
    assert "'amp-a' (kwplug-amp-a 1.2)" in message and "'amp-b' (kwplug-amp-b 3.4)" in message
    assert "kwargs_handlers" in message and "KWPLUG_BLOCK_PLUGINS" in message


def test_passing_one_explicitly_chooses_it(kwplug_plugins: PluginSandbox) -> None:
    kwplug_plugins.add(AutocastA, name="amp-a", distribution="kwplug-amp-a")
    kwplug_plugins.add(AutocastB, name="amp-b", distribution="kwplug-amp-b")
    accelerator = Accelerator(mixed_precision="bf16", kwargs_handlers=[AutocastB()])
    with accelerator.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.float16
    assert accelerator.plan["autocast"].plugin.startswith("user[0]")


def test_blocking_one_by_its_listed_name_chooses_the_other(
    kwplug_plugins: PluginSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    kwplug_plugins.add(AutocastA, name="amp-a", distribution="kwplug-amp-a")
    kwplug_plugins.add(AutocastB, name="amp-b", distribution="kwplug-amp-b")
    monkeypatch.setenv("KWPLUG_BLOCK_PLUGINS", "kwplug-amp-b")
    accelerator = Accelerator(mixed_precision="bf16")
    with accelerator.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert accelerator.plan["autocast"].plugin == "kwplug-amp-a:amp-a"


def test_plugins_for_other_devices_or_with_declared_order_do_not_conflict(
    kwplug_plugins: PluginSandbox,
) -> None:
    kwplug_plugins.add(AutocastA, name="amp-a", distribution="kwplug-amp-a")
    kwplug_plugins.add(AutocastXpuOnly, name="amp-xpu", distribution="kwplug-xpu")
    kwplug_plugins.add(AutocastFallback, name="amp-last", distribution="kwplug-fallback")
    accelerator = Accelerator(mixed_precision="bf16")
    assert accelerator.plan["autocast"].plugin == "kwplug-amp-a:amp-a"


def test_a_malformed_device_types_declaration_fails_that_plugin_only(
    kwplug_plugins: PluginSandbox,
) -> None:
    with pytest.warns(UserWarning, match="device_types must be None or a non-empty collection"):
        record = kwplug_plugins.add(BadDeviceTypes, name="bad", distribution="kwplug-bad")
    assert record.status == "failed"
    assert "device_types" in (record.error or "")
    Accelerator()  # the others still work


def test_explain_shows_the_conflict(kwplug_plugins: PluginSandbox) -> None:
    from kwplug.cli import explain

    kwplug_plugins.add(AutocastA, name="amp-a", distribution="kwplug-amp-a", version="1.2")
    kwplug_plugins.add(AutocastB, name="amp-b", distribution="kwplug-amp-b", version="3.4")
    report = explain("cpu", "bf16")
    assert report["autocast"]["conflict"] == (
        "default plugin 'amp-a' (kwplug-amp-a 1.2) and default plugin 'amp-b' (kwplug-amp-b 3.4)"
    )
    assert "answered_by" not in report["autocast"]
    assert "conflict" not in explain("xpu", "bf16")["make_scaler"]


@attrs.define
class WrapFirst(KwargsHandler):
    @hookimpl(tryfirst=True)
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model


def test_tryfirst_is_refused_at_load(kwplug_plugins: PluginSandbox) -> None:
    # It would answer before the handlers the user passes: kwplug decides precedence.
    with pytest.warns(UserWarning, match="wrap_model marked tryfirst"):
        record = kwplug_plugins.add(WrapFirst, name="first", distribution="kwplug-first")
    assert record.status == "failed"
    assert any("marked tryfirst" in p for p in conformance_problems(WrapFirst))


@attrs.define
class OptIn(KwargsHandler):
    register_default: ClassVar[bool] = False

    @hookimpl
    def autocast(self) -> None:
        return None


def test_json_listing_shows_defaults_and_devices(kwplug_plugins: PluginSandbox) -> None:
    from kwplug.cli import plugin_rows

    kwplug_plugins.add(AutocastXpuOnly, name="amp-xpu", distribution="kwplug-xpu")
    kwplug_plugins.add(OptIn, name="opt-in", distribution="kwplug-opt-in")
    rows = {r["name"]: r for r in plugin_rows(kwplug_plugins.records())}
    assert (rows["amp-xpu"]["default"], rows["amp-xpu"]["device_types"]) == (True, ["xpu"])
    assert (rows["opt-in"]["default"], rows["opt-in"]["device_types"]) == (False, None)
    assert (rows["ddp"]["default"], rows["ddp"]["device_types"]) == (True, None)
    assert rows["ddp_comm_hooks"]["default"] is True  # a module: always registered

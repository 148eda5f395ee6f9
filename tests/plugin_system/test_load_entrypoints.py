"""pluggy's ``load_setuptools_entrypoints`` on kwplug's manager goes through discovery.

pluggy's own implementation read every installed distribution, ``ep.load()``-ed each entry
point of the group and registered the raw object under the bare entry-point name: on an
Accelerator's manager it registered a third-party handler *class* (not an instance) as
``"fully_sharded"`` and then raised ``ValueError`` on the first built-in module kwplug had
registered already (``kwplug:aim``), leaving the manager half-changed; a broken third-party
plugin's exception went straight to the caller; the loading controls, the import guard and
the sandbox's isolation were bypassed. Every test here failed before.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from kwplug import Accelerator, KwargsHandler, hookimpl
from kwplug._plugins import GROUP, KwplugPluginManager, discover, set_visible, visible
from kwplug.errors import PluginLoadWarning
from kwplug.testing import PluginSandbox


@attrs.define
class LateWrap(KwargsHandler):
    """A third-party default answering ``wrap_model`` (declines: returns ``None``)."""

    @hookimpl
    def wrap_model(self, model: Any) -> None:
        return None


@attrs.define
class NotByDefault(KwargsHandler):
    """A third-party handler that is registered only when the user passes it."""

    register_default = False

    @hookimpl
    def wrap_model(self, model: Any) -> None:
        return None


def _third_party(pm: KwplugPluginManager) -> list[str]:
    return sorted(name for name, _ in pm.list_name_plugin() if pm.is_third_party(name))


def test_an_empty_manager_loads_what_an_accelerator_registers(
    kwplug_plugins: PluginSandbox,
) -> None:
    kwplug_plugins.add(LateWrap, name="late", distribution="kwplug-late", version="1.0")
    expected = KwplugPluginManager.for_handlers([], discover())
    pm = KwplugPluginManager()
    count = pm.load_setuptools_entrypoints(GROUP)
    names = dict(pm.list_name_plugin())
    assert count == len(names) == len(expected.list_name_plugin())
    assert sorted(names) == sorted(name for name, _ in expected.list_name_plugin())
    assert "kwplug:ddp" in names and "ddp" not in names
    # instances, as kwplug registers defaults, never the handler class itself
    assert not any(isinstance(plugin, type) for plugin in names.values())
    assert type(names["kwplug-late:late"]) is LateWrap
    # only the sandbox's plugins: nothing installed outside it (kwplug-fsdp, kwplug-compress)
    assert _third_party(pm) == ["kwplug-late:late"]
    assert pm.describe("kwplug-late:late") == "default plugin 'late' (kwplug-late 1.0)"
    assert pm.describe("kwplug:ddp") == expected.describe("kwplug:ddp")
    # the same precedence as the Accelerator's: pluggy asks the last registered first
    assert [i.plugin_name for i in pm.hook_impls("wrap_model")] == [
        i.plugin_name for i in expected.hook_impls("wrap_model")
    ]
    assert pm.load_setuptools_entrypoints(GROUP) == 0  # everything is there now


def test_an_accelerators_manager_gets_only_what_it_lacks(kwplug_plugins: PluginSandbox) -> None:
    Accelerator(cpu=True)  # builds the template the next Accelerator's manager is copied from
    accelerator = Accelerator(cpu=True)
    pm = accelerator.plugin_manager
    assert type(pm.hook).__name__ == "_Relay"  # a copied manager (kwplug._plugins._reuse)
    before = dict(pm.list_name_plugin())
    kwplug_plugins.add(LateWrap, name="late", distribution="kwplug-late")  # installed later
    assert pm.load_setuptools_entrypoints(GROUP) == 1
    after = dict(pm.list_name_plugin())
    assert set(after) - set(before) == {"kwplug-late:late"}
    assert all(after[name] is plugin for name, plugin in before.items())  # nothing replaced
    assert pm.is_third_party("kwplug-late:late")
    # registered last, so pluggy asks it first: before the built-ins (and the user's handlers)
    assert pm.hook_impls("wrap_model")[-1].plugin_name == "kwplug-late:late"
    accelerator.prepare(torch.nn.Linear(2, 2))
    assert accelerator.plan["wrap_model"].asked[0] == "kwplug-late:late"
    assert pm.load_setuptools_entrypoints(GROUP) == 0


def test_a_handler_class_the_user_passed_is_not_loaded_again(
    kwplug_plugins: PluginSandbox,
) -> None:
    kwplug_plugins.add(LateWrap, name="late", distribution="kwplug-late")
    kwplug_plugins.add(NotByDefault, name="opt-in", distribution="kwplug-opt-in")
    mine = LateWrap()
    pm = Accelerator(cpu=True, kwargs_handlers=[mine]).plugin_manager
    assert pm.load_setuptools_entrypoints(GROUP) == 0  # LateWrap: the user's instance is there
    assert [p for p in pm.get_plugins() if isinstance(p, (LateWrap, NotByDefault))] == [mine]


def test_name_selects_one_entry_point(kwplug_plugins: PluginSandbox) -> None:
    kwplug_plugins.add(LateWrap, name="late", distribution="kwplug-late")
    pm = KwplugPluginManager()
    assert pm.load_setuptools_entrypoints(GROUP, name="nothing-of-that-name") == 0
    assert pm.load_setuptools_entrypoints(GROUP, name="late") == 1
    assert [name for name, _ in pm.list_name_plugin()] == ["kwplug-late:late"]
    assert pm.load_setuptools_entrypoints(GROUP, name="kwplug:ddp") == 1  # or its full name
    assert pm.has_plugin("kwplug:ddp")


def test_pluggy_blocking_and_kwplugs_loading_controls_are_respected(
    kwplug_plugins: PluginSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    kwplug_plugins.add(LateWrap, name="late", distribution="kwplug-late")
    pm = KwplugPluginManager()
    pm.set_blocked("late")  # pluggy's own block, by the entry-point name pluggy would use
    pm.set_blocked("kwplug:ddp")  # or by the name kwplug registers it under
    pm.load_setuptools_entrypoints(GROUP)
    assert not pm.has_plugin("kwplug-late:late") and not pm.has_plugin("kwplug:ddp")
    assert pm.has_plugin("kwplug:autocast")

    monkeypatch.setenv("KWPLUG_BLOCK_PLUGINS", "kwplug-late:late")
    assert KwplugPluginManager().load_setuptools_entrypoints(GROUP, name="late") == 0


def test_a_broken_plugin_is_a_warning_naming_it_not_an_exception(
    kwplug_plugins: PluginSandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "kwplug_ep_broken.py").write_text(
        textwrap.dedent("""
            raise RuntimeError("broken at import")
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(PluginLoadWarning):  # the sandbox's own discovery reports it first
        kwplug_plugins.add("kwplug_ep_broken:Thing", name="broken", distribution="kwplug-broken")
    set_visible(visible())  # forget that discovery: the call below imports the plugin again
    pm = KwplugPluginManager()
    with pytest.warns(PluginLoadWarning) as caught:
        count = pm.load_setuptools_entrypoints(GROUP)
    assert count == len(pm.list_name_plugin()) > 0  # the built-ins loaded all the same
    assert not any(name.startswith("kwplug-broken") for name, _ in pm.list_name_plugin())
    reported = [w.message for w in caught if isinstance(w.message, PluginLoadWarning)]
    assert [(w.plugin, w.distribution) for w in reported] == [("broken", "kwplug-broken")]
    assert "broken at import" in str(reported[0])
    assert "kwplug_ep_broken" not in sys.modules


def test_another_group_is_refused_naming_the_accepted_one() -> None:
    pm = KwplugPluginManager()
    with pytest.raises(ValueError, match=r"'pytest11'.*'kwplug\.handlers'"):
        pm.load_setuptools_entrypoints("pytest11")
    assert pm.list_name_plugin() == []

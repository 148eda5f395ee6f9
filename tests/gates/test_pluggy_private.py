"""pluggy's private names that kwplug uses, listed, checked against the installed pluggy, and
bounded in ``pyproject.toml`` (issue 29, item 3).

kwplug calls hooks through pluggy's public face where the cost allows (``pm.hook.<name>``,
``HookCaller.get_hookimpls()``, ``HookImpl``'s attributes, ``add_hookcall_monitoring`` /
``enable_tracing``, which ``KwplugPluginManager`` counts). Three private names stay, for
speed or provenance; :data:`PRIVATE` says why and where. The gate fails when:

- core/ or plugins/ use a private name of pluggy's objects that :data:`PRIVATE` does not list
  (found with ``ast``: attribute accesses and string constants such as ``getattr(x, "_y")``);
- a listed name is no longer used (drop it from the list, and maybe the bound);
- the installed pluggy changed a listed name: gone, another signature or type, or no longer
  doing what kwplug relies on (each has a behavioural check below);
- ``pyproject.toml`` asks for pluggy without an upper bound, or the installed pluggy is
  outside the range.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

import pluggy
import pytest
from packaging.requirements import Requirement

from kwplug.hookspecs import HandlerSpec, hookimpl

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (ROOT / "core", ROOT / "plugins")

#: Each private pluggy name kwplug uses -> (where, why it stays).
PRIVATE: dict[str, tuple[str, str]] = {
    "_hookexec": (
        "core/_plugins/_calls.py, core/_plugins/_reuse.py",
        "PluginManager._hookexec(hook_name, methods, kwargs, firstresult): the one entry "
        "point tracing and monitoring watch; kwplug hands it recording twins of the "
        "implementations so that a watched call says who answered (no public call takes a "
        "list of implementations), and a template-copied HookCaller is built with it",
    ),
    "_hookimpls": (
        "core/_plugins/_reuse.py",
        "HookCaller._hookimpls, the list pluggy calls: a manager copied from a template fills "
        "it directly (register() inspects every attribute of every plugin: most of an "
        "Accelerator's construction)",
    ),
    "_name2plugin": (
        "core/_plugins/_manager.py, core/_plugins/_reuse.py",
        "PluginManager._name2plugin: the copied manager's registered names, in order, as "
        "register() leaves them; KwplugPluginManager replaces it with a dict whose values() "
        "tests membership by identity (handlers compare by value and do not hash), the test "
        "register() makes before adding a plugin",
    ),
    "_SubsetHookCaller": (
        "core/_plugins/_manager.py",
        "pluggy._hooks._SubsetHookCaller(orig, remove_plugins): what subset_hook_caller "
        "returns, a live proxy of the hook without some plugins; pluggy builds a set() of "
        "them (handlers do not hash), kwplug hands it an identity set (no public "
        "constructor)",
    ),
}


class _Plugin:
    @hookimpl
    def autocast(self, device_type: str) -> str:
        return f"plugin:{device_type}"


def _manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("kwplug")
    pm.add_hookspecs(HandlerSpec)
    pm.register(_Plugin(), "plugin")
    return pm


def _pluggy_private_names() -> set[str]:
    # Every single-underscore name on pluggy's objects: a manager with the specs and a
    # registered plugin, its relay, a HookCaller, a HookImpl, the markers, Result, the tracer.
    pm = _manager()
    caller = pm.hook.autocast
    objects: list[Any] = [pm, pm.hook, caller, caller.get_hookimpls()[0], pm.trace]
    objects += [pluggy.HookspecMarker, pluggy.HookimplMarker, pluggy.Result, pluggy.HookImpl]
    objects.append(importlib.import_module("pluggy._hooks"))  # its private classes
    names: set[str] = set()
    for obj in objects:
        for name in {*dir(obj), *getattr(obj, "__dict__", {})}:
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names - {"_is_protocol"}  # typing.Protocol's marker, not pluggy's


def _uses(names: set[str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for folder in SOURCES:
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pluggy"):
                    for alias in node.names:  # from pluggy._hooks import _SubsetHookCaller
                        if alias.name in names:
                            where = f"{path.relative_to(ROOT)}:{node.lineno}"
                            found.setdefault(alias.name, []).append(where)
                    continue
                if isinstance(node, ast.Attribute):
                    name = node.attr
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    name = node.value
                else:
                    continue
                if name in names:
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    found.setdefault(name, []).append(where)
    return found


def test_every_private_pluggy_name_used_is_listed() -> None:
    used = _uses(_pluggy_private_names() | set(PRIVATE))
    unlisted = {name: where for name, where in used.items() if name not in PRIVATE}
    assert not unlisted, (
        f"private pluggy names used but not listed in PRIVATE: {unlisted}; use pluggy's public "
        "API, or list the name with why it stays and a check below"
    )
    unused = set(PRIVATE) - set(used)
    assert not unused, f"listed but no longer used (drop them from PRIVATE): {sorted(unused)}"
    for name, (files, _) in PRIVATE.items():
        in_files = {where.rpartition(":")[0] for where in used[name]}
        assert in_files == set(files.split(", ")), (name, sorted(in_files))


@pytest.mark.parametrize("name", sorted(PRIVATE))
def test_listed_names_exist_in_the_installed_pluggy(name: str) -> None:
    assert name in _pluggy_private_names(), f"pluggy {pluggy.__version__} has no {name}"


def test_hookexec_is_what_kwplug_calls() -> None:
    # Its signature, and: it runs the implementations it is given (not the registered ones)
    # and is what add_hookcall_monitoring watches.
    parameters = list(inspect.signature(pluggy.PluginManager._hookexec).parameters)
    assert parameters == ["self", "hook_name", "methods", "kwargs", "firstresult"]
    pm = _manager()
    impl = pm.hook.autocast.get_hookimpls()[0]
    seen: list[str] = []
    pm.add_hookcall_monitoring(lambda hook, impls, kwargs: seen.append(hook), lambda *a: None)
    other = pluggy.HookImpl(None, "other", lambda device_type: "other", impl.opts)
    assert pm._hookexec("autocast", [other], {"device_type": "cpu"}, True) == "other"
    assert seen == ["autocast"]
    # A HookCaller built on it, as a template copy builds one.
    assert list(inspect.signature(pluggy.HookCaller).parameters)[:2] == ["name", "hook_execute"]


def test_hookimpls_is_the_list_pluggy_calls() -> None:
    pm = _manager()
    caller = pm.hook.autocast
    assert isinstance(caller._hookimpls, list)
    assert caller._hookimpls == caller.get_hookimpls()
    copy = pluggy.HookCaller("autocast", pm._hookexec)
    copy.spec = caller.spec
    copy._hookimpls.append(caller.get_hookimpls()[0])
    assert copy(device_type="cpu", mixed_precision="no") == "plugin:cpu"
    assert copy.get_hookimpls() == caller.get_hookimpls()


def test_name2plugin_is_the_registry() -> None:
    pm = _manager()
    assert isinstance(pm._name2plugin, dict)
    plugin = object()
    pm._name2plugin["added"] = plugin
    assert pm.get_plugin("added") is plugin
    assert [name for name, _ in pm.list_name_plugin()] == ["plugin", "added"]


def test_register_asks_name2plugin_values_whether_registered() -> None:
    # KwplugPluginManager's identity registry works only if register() asks
    # ``plugin in self._name2plugin.values()`` (pluggy's equality test) before adding.
    class Asked(dict[str, Any]):
        asked: list[object] = []  # noqa: RUF012

        def values(self) -> Any:
            outer = self

            class View(list[Any]):
                def __contains__(self, obj: object) -> bool:
                    outer.asked.append(obj)
                    return False

            return View(dict.values(self))

    pm = _manager()
    pm._name2plugin = Asked(pm._name2plugin)  # type: ignore[misc]
    plugin = _Plugin()
    pm.register(plugin, "second")
    assert Asked.asked == [plugin]
    assert pm.get_plugin("second") is plugin and isinstance(pm._name2plugin, Asked)


def test_subset_hook_caller_takes_any_set_of_plugins() -> None:
    # kwplug hands _SubsetHookCaller a set whose membership is identity; it must only use
    # ``in`` on it and read the original caller live.
    from pluggy._hooks import _SubsetHookCaller

    pm = _manager()
    caller = pm.hook.autocast
    plugin = caller.get_hookimpls()[0].plugin

    class Only(list[Any]):
        def __contains__(self, obj: object) -> bool:
            return any(obj is item for item in self)

    subset = _SubsetHookCaller(caller, Only([plugin]))  # type: ignore[arg-type]
    assert subset(device_type="cpu", mixed_precision="no") is None
    other = _Plugin()
    pm.register(other, "later")  # registered after the subset was made: seen
    assert subset(device_type="cpu", mixed_precision="no") == "plugin:cpu"
    assert [i.plugin for i in subset.get_hookimpls()] == [other]


def test_hookimpl_layout_kwplug_copies() -> None:
    # copy_impl and _reuse set HookImpl's slots through their descriptors.
    slots = set(getattr(pluggy.HookImpl, "__slots__", ()))
    assert {"plugin", "function", "plugin_name", "argnames", "kwargnames", "opts"} <= slots
    parameters = list(inspect.signature(pluggy.HookImpl).parameters)
    assert parameters == ["plugin", "plugin_name", "function", "hook_impl_opts"]


def test_pyproject_bounds_pluggy() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (line,) = [d for d in project["dependencies"] if Requirement(d).name == "pluggy"]
    requirement = Requirement(line)
    assert any(s.operator in ("<", "<=", "~=", "==") for s in requirement.specifier), (
        f"pyproject.toml asks {line!r}: bound pluggy's range (private names are used)"
    )
    assert requirement.specifier.contains(pluggy.__version__), (
        f"installed pluggy {pluggy.__version__} is outside {line!r}"
    )

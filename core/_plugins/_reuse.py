"""An Accelerator's plugin manager, copied from a template instead of built from scratch.

Building a :class:`KwplugPluginManager` the pluggy way (``add_hookspecs`` plus one
``register`` per plugin, each inspecting every attribute of the plugin) costs most of an
``Accelerator``'s construction, yet gives the same result every time for the same discovered
plugins and the same classes of user handlers. So the first build for a combination is
snapshotted into a :class:`_Template` -- the hook specs, the registered names in order, and
each hook's implementations in pluggy's order -- and later managers are filled from it: new
``HookCaller`` objects sharing the (immutable) specs, the user's own handler instances and
fresh default handler instances registered under the same names, their hook implementations
re-bound to those instances. Each Accelerator still gets its own manager (it may register or
unregister plugins), its own plugin objects and its own ``plan``.

A template is keyed on the discovery result (the very tuple :func:`kwplug.discover` returned,
which changes with the loading controls and after a refresh), the user handlers' classes in
order and each default handler class's ``register_default``. A combination whose plugins'
implementations are not plain methods of the instance (static or class methods, functions
stored on an instance) is never templated: it is built the pluggy way every time.

This copies pluggy's registration state (``HookCaller._hookimpls``, ``_name2plugin``), as
``_calls`` already uses ``PluginManager._hookexec``: private names that
``tests/gates/test_pluggy_private.py`` lists and checks against the installed pluggy (whose
range ``pyproject.toml`` bounds); ``tests/plugin_system/test_setup_reuse.py`` checks that a
copy equals a fresh build.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
import pluggy

from kwplug._plugins._manager import KwplugPluginManager
from kwplug._plugins._records import PluginRecord
from kwplug.handler import KwargsHandler

#: Templates kept (one per combination of discovery result and user handler classes).
MAX_TEMPLATES = 32

_USER = "user"  # a slot filled with kwargs_handlers[index]
_FRESH = "fresh"  # a slot filled with a new default instance of a handler class
_SHARED = "shared"  # a slot filled with the same object every time (a module plugin)


@attrs.frozen
class _Slot:
    # One registered plugin: its name, how messages describe it, and where its object comes
    # from (kind _USER: source is the handler index; _FRESH: the class; _SHARED: the object).
    name: str
    description: str
    third_party: bool
    kind: str
    source: Any


# (a HookImpl subclass holding the impl's attributes other than plugin and function, the
# function to bind to the new plugin object)
_Rebind = tuple[type[pluggy.HookImpl], Callable[..., Any]]

# HookImpl's slot descriptors: setting a slot through its descriptor is several times faster
# than setattr by name or copy.copy, and every Accelerator re-binds each handler's impls.
_SLOTS: dict[str, Any] = {
    name: vars(pluggy.HookImpl)[name] for name in getattr(pluggy.HookImpl, "__slots__", ())
}
_REBINDABLE = {"plugin", "function"} <= set(_SLOTS)


@attrs.frozen
class _Template:
    records: tuple[PluginRecord, ...]
    slots: tuple[_Slot, ...]
    # hook name, its spec, and its implementations in pluggy's order as (slot index, impl,
    # rebind): rebind is None for a shared plugin's impl (used as it is), else the impl's
    # constant slots as (descriptor setter, value) pairs and the method's function, to re-bind
    # to the slot's new object
    hooks: tuple[tuple[str, Any, tuple[tuple[int, pluggy.HookImpl, _Rebind | None], ...]], ...]


_templates: dict[tuple[Any, ...], _Template] = {}


def manager_for(
    handlers: Sequence[KwargsHandler], records: tuple[PluginRecord, ...]
) -> KwplugPluginManager:
    """The manager :meth:`KwplugPluginManager.for_handlers` would build, copied from a
    template when one matches.

    Raises:
        TypeError: a user handler's hookimpls fail pluggy's validation (names the class).
    """
    key = (
        id(records),
        tuple(type(h) for h in handlers),
        tuple(getattr(r.handler_class, "register_default", None) for r in records),
    )
    template = _templates.get(key)
    if template is not None and template.records is records:  # not a reused id
        return _fill(template, handlers)
    pm = KwplugPluginManager.for_handlers(handlers, records)
    template = _snapshot(pm, handlers, records)
    if template is not None:
        if len(_templates) >= MAX_TEMPLATES:
            _templates.clear()
        _templates[key] = template
    return pm


def clear() -> None:
    """Forget every template (the next manager of each combination is built afresh)."""
    _templates.clear()


def _snapshot(
    pm: KwplugPluginManager, handlers: Sequence[KwargsHandler], records: tuple[PluginRecord, ...]
) -> _Template | None:
    # A just-built manager as a template, or None when it cannot be copied faithfully.
    if not _REBINDABLE:  # a pluggy whose HookImpl has no plugin/function slots
        return None
    user = {id(h): index for index, h in enumerate(handlers)}
    slots: list[_Slot] = []
    index_of: dict[int, int] = {}
    for name, plugin in pm.list_name_plugin():
        kind: str
        source: Any
        if id(plugin) in user:
            kind, source = _USER, user[id(plugin)]
        elif isinstance(plugin, KwargsHandler):
            kind, source = _FRESH, type(plugin)
        else:
            kind, source = _SHARED, plugin
        index_of[id(plugin)] = len(slots)
        slots.append(_Slot(name, pm.describe(name), pm.is_third_party(name), kind, source))
    hooks = []
    for name, caller in vars(pm.hook).items():
        if not isinstance(caller, pluggy.HookCaller) or caller.is_historic():
            return None
        impls = []
        for impl in caller.get_hookimpls():
            slot = slots[index_of[id(impl.plugin)]]
            bound = getattr(impl.function, "__self__", None) is impl.plugin
            if slot.kind != _SHARED and not (isinstance(impl.function, types.MethodType) and bound):
                return None  # not a plain method of the instance: cannot be re-bound
            impls.append((index_of[id(impl.plugin)], impl, _rebind(impl, slot.kind)))
        hooks.append((name, caller.spec, tuple(impls)))
    return _Template(records, tuple(slots), tuple(hooks))


def _fill(template: _Template, handlers: Sequence[KwargsHandler]) -> KwplugPluginManager:
    pm = KwplugPluginManager(specs=False)
    objects: list[Any] = []
    for slot in template.slots:
        if slot.kind == _USER:
            obj = handlers[slot.source]
        elif slot.kind == _FRESH:
            obj = slot.source()
        else:
            obj = slot.source
        objects.append(obj)
        pm._name2plugin[slot.name] = obj  # registration order, as register() left it
        pm._descriptions[slot.name] = slot.description
        if slot.third_party:
            pm._third_party.add(slot.name)
    new, method = object.__new__, types.MethodType
    set_plugin, set_function = _SLOTS["plugin"].__set__, _SLOTS["function"].__set__
    hookexec = pm._hookexec
    for name, spec, impls in template.hooks:
        caller = pluggy.HookCaller(name, hookexec)
        caller.spec = spec
        out = caller._hookimpls
        for index, impl, rebind in impls:
            if rebind is None:
                out.append(impl)
                continue
            constant, function = rebind
            obj = objects[index]
            twin = new(constant)
            set_plugin(twin, obj)
            set_function(twin, method(function, obj))
            out.append(twin)
        setattr(pm.hook, name, caller)
    return pm


def _rebind(impl: pluggy.HookImpl, kind: str) -> _Rebind | None:
    # How _fill re-binds ``impl`` to a new object of its slot (None: a shared plugin's impl).
    if kind == _SHARED:
        return None
    # A subclass whose class attributes are the impl's options and argument names: they
    # shadow HookImpl's slots (read-only for pluggy, which never assigns them after
    # __init__), so a copy sets two slots instead of eleven -- this runs for every user or
    # fresh handler implementation of every Accelerator.
    constant = {
        name: descriptor.__get__(impl)
        for name, descriptor in _SLOTS.items()
        if name not in ("plugin", "function")
    }
    subclass = type(pluggy.HookImpl.__name__, (pluggy.HookImpl,), {"__slots__": (), **constant})
    subclass.__module__ = pluggy.HookImpl.__module__
    return subclass, cast(types.MethodType, impl.function).__func__

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
``_calls`` already uses ``PluginManager._hookexec``; ``tests/test_setup_reuse.py`` checks that
a copy equals a fresh build.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any, cast

import attrs
import pluggy

from kwplug._plugins._calls import copy_impl
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


@attrs.frozen
class _Template:
    records: tuple[PluginRecord, ...]
    slots: tuple[_Slot, ...]
    # hook name, its spec, and its implementations in pluggy's order as (slot index, impl)
    hooks: tuple[tuple[str, Any, tuple[tuple[int, pluggy.HookImpl], ...]], ...]


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
            impls.append((index_of[id(impl.plugin)], impl))
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
    for name, spec, impls in template.hooks:
        caller = pluggy.HookCaller(name, pm._hookexec)
        caller.spec = spec
        for index, impl in impls:
            obj = objects[index]
            if template.slots[index].kind != _SHARED:
                method = cast(types.MethodType, impl.function)
                impl = copy_impl(impl, obj, types.MethodType(method.__func__, obj))
            caller._hookimpls.append(impl)
        setattr(pm.hook, name, caller)
    return pm

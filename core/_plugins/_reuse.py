"""An Accelerator's plugin manager, copied from a template instead of built from scratch.

Building a :class:`KwplugPluginManager` the pluggy way (``add_hookspecs`` plus one
``register`` per plugin, each inspecting every attribute of the plugin) costs most of an
``Accelerator``'s construction, yet gives the same result every time for the same discovered
plugins and the same classes of user handlers. So the first build for a combination is
snapshotted into a :class:`_Template` -- the hook specs, the registered names in order, and
each hook's implementations in pluggy's order -- and later managers are filled from it: the
user's own handler instances and fresh default handler instances registered under the same
names, and new ``HookCaller`` objects sharing the (immutable) specs, their hook
implementations re-bound to those instances. Each Accelerator still gets its own manager (it
may register or unregister plugins), its own plugin objects and its own ``plan``.

Two things keep a copy cheap (issue 31, goal 3). A fresh default instance is a copy of one
built before in the same environment (:class:`kwplug._contracts.pristine.Pristine`: built-in
handler classes only, ``os.environ`` compared whole), not a new construction running its
validators and environment reads again. And a ``HookCaller`` is made the first time the hook
is asked for (:class:`_Relay`): a repeated construction asks one or two of them.

A template is keyed on the discovery result (the very tuple :func:`kwplug.discover` returned,
which changes with the loading controls and after a refresh), the user handlers' classes in
order and each default handler class's ``register_default``. A combination whose plugins'
implementations are not plain methods of the instance (static or class methods, functions
stored on an instance) is never templated: it is built the pluggy way every time.

This copies pluggy's registration state (``HookCaller._hookimpls``, ``_name2plugin``), as
``_calls`` already uses ``PluginManager._hookexec``: private names that
``tests/gates/test_pluggy_private.py`` lists and checks against the installed pluggy (whose
range ``pyproject.toml`` bounds); ``tests/plugin_system/test_setup_reuse.py`` checks that a
copy equals a fresh build, ``tests/plugin_system/test_construct_copies.py`` that copies stay
independent and that pluggy's ``unregister`` and monitoring see the lazily made callers.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
import pluggy

from kwplug._contracts.pristine import Pristine
from kwplug._plugins._manager import KwplugPluginManager
from kwplug._plugins._records import PluginRecord, register_defaults
from kwplug.handler import KwargsHandler

#: Templates kept (one per combination of discovery result and user handler classes).
MAX_TEMPLATES = 32

_USER = "user"  # a slot filled with kwargs_handlers[index]
_FRESH = "fresh"  # a slot filled with a new default instance of a handler class (or a copy)
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


# One hook of a template: its spec, and its implementations in pluggy's order as (slot index,
# impl, rebind): rebind is None for a shared plugin's impl (used as it is), else how to re-bind
# the impl to the slot's new object.
_Hook = tuple[Any, tuple[tuple[int, pluggy.HookImpl, _Rebind | None], ...]]


@attrs.frozen
class _Template:
    records: tuple[PluginRecord, ...]
    slots: tuple[_Slot, ...]
    hooks: dict[str, _Hook]  # by hook name, in the order the built manager's relay held them
    # The same facts as the slots hold, laid out for _fill's bulk updates.
    names: tuple[str, ...] = attrs.field(init=False)
    descriptions: dict[str, str] = attrs.field(init=False)
    third_party: frozenset[str] = attrs.field(init=False)
    fresh: tuple[type, ...] = attrs.field(init=False)  # the _FRESH slots' classes, in order
    # The hooks whose implementations are all shared plugins' (used as they are): a copied
    # manager's implementations of such a hook are these very objects until it changes.
    shared: dict[str, tuple[pluggy.HookImpl, ...]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(slot.name for slot in self.slots))
        descriptions = {slot.name: slot.description for slot in self.slots}
        object.__setattr__(self, "descriptions", descriptions)
        third_party = frozenset(slot.name for slot in self.slots if slot.third_party)
        object.__setattr__(self, "third_party", third_party)
        fresh = tuple(slot.source for slot in self.slots if slot.kind == _FRESH)
        object.__setattr__(self, "fresh", fresh)
        shared = {
            name: tuple(impl for _, impl, _ in impls)
            for name, (_, impls) in self.hooks.items()
            if all(rebind is None for _, _, rebind in impls)
        }
        object.__setattr__(self, "shared", shared)


# pluggy marks HookRelay final for type checkers; the subclass only makes its attributes on
# first use, and isinstance(pm.hook, pluggy.HookRelay) stays true for code that checks.
class _Relay(pluggy.HookRelay):  # type: ignore[misc]
    """A copied manager's ``pm.hook``: each ``HookCaller`` is made from the template the first
    time it is asked for.

    A repeated construction asks one or two of the ~16 hooks (set-up answers are replayed), so
    making all of them eagerly was a third of the manager copy. A made caller is an ordinary
    attribute of the relay (Python finds it without coming here again). Everything that
    enumerates the callers reads ``__dict__`` (``vars(pm.hook)``, pluggy's ``unregister`` ->
    ``get_hookcallers`` and ``check_pending``), so reading it makes every caller not made yet
    first: the relay then looks exactly like an eagerly filled one.
    """

    __slots__ = ("_hookexec", "_hooks", "_objects", "_shared")

    def __init__(
        self,
        template: _Template,
        objects: list[Any],
        hookexec: Callable[..., Any],
    ) -> None:
        super().__init__()
        self._hooks = template.hooks  # the template's hooks (shared, never changed)
        self._shared = template.shared  # likewise
        self._objects = objects  # the new manager's plugin objects, by slot index
        self._hookexec = hookexec  # the new manager's _hookexec, as register() would use

    def peek_hookimpls(self, name: str) -> list[pluggy.HookImpl] | None:
        """What ``getattr(self, name).get_hookimpls()`` answers, without making the caller,
        for a hook not made yet whose implementations are all shared plugins' (the
        ``comm_hooks`` call of every construction: a caller made for one call is garbage);
        ``None`` otherwise (ask the caller).

        Every change of a hook's registrations (``register``, ``unregister``) goes through its
        caller, which is made first: while it is not made, the template's list is the hook's.
        """
        if name in _RELAY_DICT.__get__(self):
            return None
        shared = self._shared.get(name)
        return None if shared is None else list(shared)

    def __getattr__(self, name: str) -> pluggy.HookCaller:
        # Reached only for a name that is not an attribute yet: a hook not made yet, or none.
        hook = _hooks(self).get(name)
        if hook is None:
            raise AttributeError(name)
        caller = _caller(name, hook, self._objects, self._hookexec)
        # setdefault: two threads making the same caller at once both get the one kept.
        kept: pluggy.HookCaller = _RELAY_DICT.__get__(self).setdefault(name, caller)
        return kept

    @property
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]  # the same dict, complete
        """Every hook caller by name (the ones not made yet are made first)."""
        made = _RELAY_DICT.__get__(self)
        for name in _hooks(self):
            if name not in made:
                getattr(self, name)
        return made  # type: ignore[no-any-return]


def _hooks(relay: _Relay) -> dict[str, _Hook]:
    # The template's hooks, read past __getattr__: a relay made without __init__ (copy.copy)
    # has no _hooks, and asking __getattr__ for it would recurse.
    try:
        hooks: dict[str, _Hook] = object.__getattribute__(relay, "_hooks")
    except AttributeError:
        return {}
    return hooks


# HookRelay's instance dict, read past _Relay's __dict__ property.
_RELAY_DICT: Any = vars(pluggy.HookRelay).get("__dict__")

_templates: dict[tuple[Any, ...], _Template] = {}

# The default handler instances, built once per class and environment and copied for each
# manager (building one runs its validators and, for some, reads os.environ: most of a
# copy's cost); a class whose copy could differ from a new instance is built every time.
_defaults = Pristine()


def manager_for(
    handlers: Sequence[KwargsHandler],
    records: tuple[PluginRecord, ...],
    defaults: tuple[bool, ...] | None = None,
) -> KwplugPluginManager:
    """The manager :meth:`KwplugPluginManager.for_handlers` would build, copied from a
    template when one matches.

    Args:
        handlers: the user's handler objects.
        records: the discovery result.
        defaults: ``register_defaults(records)`` when the caller has just read it (the set-up
            cache's key needs it too); ``None``: read here.

    Raises:
        TypeError: a user handler's hookimpls fail pluggy's validation (names the class).
    """
    if defaults is None:
        defaults = register_defaults(records)
    key = (id(records), tuple([type(h) for h in handlers]), defaults)
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
    """Forget every template and kept default instance (the next manager of each combination
    is built afresh)."""
    _templates.clear()
    _defaults.clear()


def _snapshot(
    pm: KwplugPluginManager, handlers: Sequence[KwargsHandler], records: tuple[PluginRecord, ...]
) -> _Template | None:
    # A just-built manager as a template, or None when it cannot be copied faithfully.
    if not _REBINDABLE or _RELAY_DICT is None:  # a pluggy unlike the ones checked
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
    hooks: dict[str, _Hook] = {}
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
        hooks[name] = (caller.spec, tuple(impls))
    return _Template(records, tuple(slots), hooks)


def _fill(template: _Template, handlers: Sequence[KwargsHandler]) -> KwplugPluginManager:
    pm = KwplugPluginManager(specs=False)
    _defaults.check()  # the environment the kept defaults were built in, or forget them
    fresh = iter(_defaults.each(template.fresh))  # the default instances, in slot order
    objects: list[Any] = [
        handlers[slot.source]
        if slot.kind == _USER
        else next(fresh)
        if slot.kind == _FRESH
        else slot.source
        for slot in template.slots
    ]
    pm._name2plugin.update(zip(template.names, objects, strict=True))  # in register() order
    pm._descriptions.update(template.descriptions)
    pm._third_party.update(template.third_party)
    # pluggy declares ``hook`` Final; this manager is new and nothing has read it yet.
    pm.hook = _Relay(template, objects, pm._hookexec)  # type: ignore[misc]
    return pm


def _caller(
    name: str, hook: _Hook, objects: list[Any], hookexec: Callable[..., Any]
) -> pluggy.HookCaller:
    # One HookCaller of a copied manager: the template's spec and implementations, each
    # user or default handler's re-bound to the manager's own object.
    spec, impls = hook
    caller = pluggy.HookCaller(name, hookexec)
    caller.spec = spec
    out = caller._hookimpls
    new, method = object.__new__, types.MethodType
    set_plugin, set_function = _SLOTS["plugin"].__set__, _SLOTS["function"].__set__
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
    return caller


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

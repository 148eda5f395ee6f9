"""The set-up hooks' answers of a built-in-only construction, reused by the next identical one.

``Accelerator()`` called again with the same arguments, in the same environment, with the
same discovered plugins, gets the same device, autocast factory and ``plan`` answers from
the built-in plugins' set-up hooks every time: calling them again (each call re-validating
the handlers and recording who answered) is most of a repeated construction's cost. So a
construction that qualifies keeps those answers here, and the next one with the same key
takes them instead of asking the hooks (issue 31, goal 3).

A construction qualifies only when nothing can make a second one differ:

- user handlers, if any, are of kwplug's built-in classes and hold only plain values (None,
  numbers, strings, enums, time spans, and lists, tuples and dicts of them): the key holds
  a snapshot of every attrs field of each (a handler object may be mutated between
  constructions, in place too, so the objects themselves are never kept);
- every implementation of a set-up hook whose answer is reused belongs to a built-in
  plugin (a third-party one may answer differently each time; the ``comm_hooks`` hook,
  which a third-party plugin may implement, is called every time, and the cached
  ``validate_setup`` outcome is used only while its merged names equal the cached ones);
- one process, no process group, no device mesh, no loss scaler (which holds training
  state and is built anew for every Accelerator);
- nothing watches the manager (``KWPLUG_TRACE_PLUGINS``, ``enable_tracing``,
  ``add_hookcall_monitoring``) and hook calls are not logged at ``DEBUG``: then every hook
  is called, so the watcher sees each call.

The key is the arguments, the user handlers' snapshots, the identity of
:func:`kwplug._plugins.discover`'s result (a new tuple after a refresh or a change of the
loading controls) and each record's ``register_default``; an entry also holds a copy of the
whole environment (``os.environ``) taken before the hooks ran, and is used only while the
environment still equals it.
"""

from __future__ import annotations

import datetime
import enum
import logging
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch.distributed as dist

from kwplug._plugins import Answer, KwplugPluginManager, PluginRecord, register_defaults
from kwplug._process.environment import ProcessInfo
from kwplug._runtime import Device
from kwplug.comm_hooks import CommHook
from kwplug.handler import KwargsHandler
from kwplug.hookspecs import AutocastFactory

#: Entries kept (one per combination of arguments and discovery result).
MAX_ENTRIES = 16

#: The set-up hooks whose answers an entry replays; every implementation must be built-in.
REPLAYED_HOOKS = (
    "select_device",
    "device_mesh",
    "autocast",
    "make_scaler",
    "validate_setup",
    "init_process_group",
)

# The logger whose DEBUG records name who answered each hook call (kwplug._plugins._calls).
_CALLS_LOGGER = logging.getLogger("kwplug._plugins._manager")


@attrs.frozen
class Entry:
    """What a qualifying construction resolved, to replay.

    Attributes:
        records: the discovery result it was built from (compared by identity).
        environ: the environment before its hooks ran (``os.environ``'s own mapping).
        info: the ranks it read.
        chosen: the device choice.
        comm_hooks: the merged communication hooks ``validate_setup`` was given.
        autocast_factory: the ``autocast`` answer (or ``contextlib.nullcontext``).
        answers: the manager's ``plan`` entries, in call order.
    """

    records: tuple[PluginRecord, ...]
    environ: dict[Any, Any]
    info: ProcessInfo
    chosen: Device
    comm_hooks: dict[str, CommHook]
    autocast_factory: AutocastFactory
    answers: tuple[tuple[str, Answer], ...]


_entries: dict[tuple[Any, ...], Entry] = {}


def clear() -> None:
    """Forget every entry and the plain value types learned (the next construction asks the
    hooks again)."""
    _entries.clear()
    _plain_types.clear()


def environ() -> dict[Any, Any] | None:
    """A copy of the environment as ``os.environ`` holds it, or ``None`` on a Python whose
    ``os.environ`` keeps it elsewhere (then nothing is cached)."""
    data = getattr(os.environ, "_data", None)  # CPython: the encoded key -> value dict
    return dict(data) if isinstance(data, dict) else None


def key(
    mixed_precision: str,
    cpu: bool,
    handlers: Sequence[KwargsHandler],
    records: tuple[PluginRecord, ...],
    defaults: tuple[bool, ...] | None = None,
) -> tuple[Any, ...] | None:
    """The entry key of a construction, or ``None`` when it cannot qualify (a handler of
    another class or holding another kind of value, logged hook calls, a process group).

    ``defaults``: ``register_defaults(records)`` when the caller has just read it (``None``:
    read here)."""
    if _CALLS_LOGGER.isEnabledFor(logging.DEBUG):
        return None
    if dist.is_available() and dist.is_initialized():
        return None
    try:
        states = tuple([_snapshot(handler) for handler in handlers]) if handlers else ()
    except _Unkeyable:
        return None
    return (
        mixed_precision,
        cpu,
        states,
        id(records),
        register_defaults(records) if defaults is None else defaults,
    )


class _Unkeyable(Exception):
    """A handler whose state cannot be part of a key."""


_PLAIN = (type(None), bool, int, float, str, bytes, enum.Enum, datetime.timedelta)


# Per built-in handler class, its attrs fields' values in one call (operator.attrgetter).
_values_of: dict[type, Callable[[Any], tuple[Any, ...]]] = {}
# The exact types of plain values seen so far (subclasses of _PLAIN): a handler holding only
# these is keyed by its values and their types as they are, without _frozen per value.
_plain_types: set[type] = set()


def _snapshot(handler: KwargsHandler) -> tuple[Any, ...]:
    # Every attrs field (eq=False ones too: they may steer a hook), with each value's type, so
    # that 1 and True, or a list and a tuple, give different keys.
    cls = type(handler)
    values_of = _values_of.get(cls)
    if values_of is None:
        if not cls.__module__.startswith("kwplug.") or not attrs.has(cls):
            raise _Unkeyable
        values_of = _values_of[cls] = _getter([f.name for f in attrs.fields(cls)])
    values = values_of(handler)
    kinds = tuple(map(type, values))
    if _plain_types.issuperset(kinds):
        return (cls, kinds, values)
    frozen = tuple(map(_frozen, values))  # learns the plain types it meets
    # One key per state: a handler of plain values met for the first time gets the form
    # later constructions compute (else the first construction's entry never matches).
    if _plain_types.issuperset(kinds):
        return (cls, kinds, values)
    return (cls, None, frozen)


def _getter(names: list[str]) -> Callable[[Any], tuple[Any, ...]]:
    if len(names) > 1:
        return operator.attrgetter(*names)
    return lambda handler: tuple(getattr(handler, name) for name in names)


def _frozen(value: Any) -> Any:
    if isinstance(value, _PLAIN):
        _plain_types.add(type(value))
        return (type(value), value)
    if type(value) in (list, tuple):
        return (type(value), tuple(_frozen(v) for v in value))
    if type(value) is dict:
        return (dict, tuple((_frozen(k), _frozen(v)) for k, v in value.items()))
    raise _Unkeyable


def lookup(
    entry_key: tuple[Any, ...] | None,
    records: tuple[PluginRecord, ...],
    plugins: KwplugPluginManager,
) -> Entry | None:
    """The entry to replay for this construction, if one matches and nothing watches
    ``plugins``."""
    if entry_key is None or plugins.watched:
        return None
    entry = _entries.get(entry_key)
    if entry is None or entry.records is not records:  # not a reused id
        return None
    data = getattr(os.environ, "_data", None)
    return entry if data == entry.environ else None


def store(
    entry_key: tuple[Any, ...] | None,
    before: dict[Any, Any] | None,
    plugins: KwplugPluginManager,
    entry: Entry,
    *,
    replayable: bool,
) -> None:
    """Keep ``entry`` under ``entry_key`` when the construction qualifies: ``replayable``
    (one process, no mesh, no scaler), the environment unchanged since ``before``, nothing
    watching ``plugins`` and every replayed hook answered by built-ins only."""
    if entry_key is None or before is None or not replayable or plugins.watched:
        return
    if getattr(os.environ, "_data", None) != before or not _built_in_only(plugins):
        return
    if len(_entries) >= MAX_ENTRIES:
        _entries.clear()
    _entries[entry_key] = entry


def plan_entries(plan: Mapping[str, Answer]) -> tuple[tuple[str, Answer], ...]:
    """``plan``'s entries, in order, to replay into another manager's plan."""
    return tuple(plan.items())


def _built_in_only(plugins: KwplugPluginManager) -> bool:
    for hook in REPLAYED_HOOKS:
        caller = getattr(plugins.hook, hook, None)
        if caller is None:
            return False
        if any(plugins.is_third_party(impl.plugin_name) for impl in caller.get_hookimpls()):
            return False
    return True

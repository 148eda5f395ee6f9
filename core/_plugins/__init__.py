"""kwplug's plugin machinery (private: import what you need from :mod:`kwplug`). The rest of
kwplug imports this package's face, the names below, never its modules
(``tests/gates/test_layers.py``).

One object, :class:`KwplugPluginManager`, holds an Accelerator's plugins; the modules around
it each own one concern:

- ``_discovery``: reads the ``kwplug.handlers`` entry points, loads and validates plugins.
- ``_records``: :class:`PluginRecord`, what discovery knows about one entry point.
- ``_controls``: the ``KWPLUG_*`` loading controls.
- ``_api_range``: the kwplug version range a plugin's distribution requires.
- ``_rules``: every "is this a valid plugin" rule (discovery and ``kwplug.testing`` share it).
- ``_manager``: the manager (names, descriptions, third-party status, hook relays).
- ``_defaults``: which discovered plugins a manager registers by default, under which names.
- ``_entrypoints``: pluggy's ``load_setuptools_entrypoints`` on the manager, through discovery.
- ``_relays``: the typed hook relays, ``plugins.first.<hook>(...)`` / ``plugins.each.<hook>(...)``.
- ``_calls``: ``HookCalls``, the one caller: record, run through pluggy's ``_hookexec``, answer.
- ``_impls``: pluggy's ``HookImpl`` as the caller handles it (plain-call arguments, copies).
- ``_conflicts``: two third-party defaults claiming one one-answer hook.
- ``_clashes``: one entry-point name declared by several distributions (warned, listed).
- ``_reuse``: :func:`manager_for`, an Accelerator's manager copied from a template.
"""

from __future__ import annotations

from kwplug._plugins._cache import EntryPointLike
from kwplug._plugins._calls import Answer
from kwplug._plugins._clashes import clash_lines
from kwplug._plugins._controls import LoadControls, control_name
from kwplug._plugins._discovery import (
    discover,
    listen_imports,
    set_visible,
    strict_error,
    visible,
)
from kwplug._plugins._entrypoints import load_handlers
from kwplug._plugins._manager import TRACE_ENV, KwplugPluginManager, use_entry_point_loader
from kwplug._plugins._records import GROUP, PluginRecord, register_defaults
from kwplug._plugins._reuse import manager_for
from kwplug._plugins._rules import (
    device_types_problem,
    require_handler_instance,
    require_handler_list,
    spec_signatures,
    tryfirst_problem,
    validate_hookimpls,
)

# The manager's module cannot import discovery (discovery validates plugins with a manager):
# it gets its load_setuptools_entrypoints from here, before anyone can build a manager.
use_entry_point_loader(load_handlers)

__all__ = [
    "GROUP",
    "TRACE_ENV",
    "Answer",
    "EntryPointLike",
    "KwplugPluginManager",
    "LoadControls",
    "PluginRecord",
    "clash_lines",
    "control_name",
    "device_types_problem",
    "discover",
    "listen_imports",
    "manager_for",
    "register_defaults",
    "require_handler_instance",
    "require_handler_list",
    "set_visible",
    "spec_signatures",
    "strict_error",
    "tryfirst_problem",
    "validate_hookimpls",
    "visible",
]

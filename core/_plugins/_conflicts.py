"""The conflict policy: two third-party defaults may not both claim a one-answer hook.

Each hook spec declares how several plugins' answers combine (``HOOK_POLICY`` in
:mod:`kwplug.hookspecs`, derived from the specs). For the one-answer hooks (``autocast``,
``wrap_model``, ``make_scaler``, ``init_process_group``, ``make_profiler``) the first
non-``None`` answer wins, so when two third-party plugins, both registered by default,
implement one of them for the same device, which one acts would depend on the order of their
distribution names. kwplug refuses to guess: the :class:`~kwplug.Accelerator` raises
:class:`~kwplug.errors.PluginConflictError` naming both plugins, with distribution and version,
and how to choose.

A plugin says which devices it answers for with a ``device_types`` attribute (a class
variable of a handler, or a module-level name of a module plugin): a collection of
``torch.device(...).type`` strings, e.g. ``frozenset({"xpu"})``. Without it, a plugin claims
every device. Hook implementations marked ``trylast`` have declared themselves fallbacks and do
not conflict (``tryfirst`` is refused at load: it would answer before the user's handlers).
Handlers the user passes in ``kwargs_handlers`` never conflict: they answer first, and passing
one is how a user chooses.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any, Protocol

import pluggy

from kwplug.errors import PluginConflictError
from kwplug.hookspecs import HOOK_POLICY, ONE_ANSWER


class Claimants(Protocol):
    """What the check reads of a plugin manager (a ``KwplugPluginManager`` is one; it calls
    the check, so this module does not import it)."""

    def hook_impls(self, hook: str) -> list[pluggy.HookImpl]: ...

    def is_third_party(self, name: str) -> bool: ...

    def describe(self, name: str) -> str: ...


def device_types(plugin: Any) -> Set[str] | None:
    """The device types ``plugin`` declares (``None``: every device)."""
    declared = getattr(plugin, "device_types", None)
    return None if declared is None else frozenset(declared)


def find_conflicts(pm: Claimants, device_type: str) -> dict[str, str]:
    """Hook name -> the plugins (described) that claim it for ``device_type``, for each
    one-answer hook claimed by two or more third-party defaults of ``pm`` (empty: no
    conflict)."""
    found: dict[str, str] = {}
    for hook_name, policy in HOOK_POLICY.items():
        if policy != ONE_ANSWER:
            continue
        claimants = [
            impl.plugin_name
            for impl in reversed(pm.hook_impls(hook_name))
            if pm.is_third_party(impl.plugin_name)
            and not impl.trylast
            and _claims(impl.plugin, device_type)
        ]
        if len(claimants) > 1:
            found[hook_name] = " and ".join(pm.describe(n) for n in claimants)
    return found


def conflict_error(conflicts: dict[str, str], device_type: str) -> PluginConflictError:
    """The error for the non-empty ``conflicts`` that :func:`find_conflicts` found: it names
    every conflicting hook and plugin, and the two ways to choose (pass one plugin's handler in
    ``kwargs_handlers``, or block the others with ``KWPLUG_BLOCK_PLUGINS`` / allow-list with
    ``KWPLUG_PLUGINS``)."""
    return PluginConflictError(
        "kwplug: third-party plugins installed with default handlers both claim the same "
        "hook, and kwplug will not pick one by name order: "
        + "; ".join(
            f"hook {hook!r} for device {device_type!r}: {names}"
            for hook, names in conflicts.items()
        )
        + ". Choose one: pass its handler in kwargs_handlers (it then answers first), or "
        "block the other by the name `kwplug plugins` shows (KWPLUG_BLOCK_PLUGINS=name, or "
        "allow-list with KWPLUG_PLUGINS); a plugin for other devices should declare "
        "device_types.",
        conflicts=conflicts,
        device_type=device_type,
    )


def _claims(plugin: Any, device_type: str) -> bool:
    declared = device_types(plugin)
    return declared is None or device_type in declared

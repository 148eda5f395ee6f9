"""pluggy's ``load_setuptools_entrypoints`` on kwplug's manager: the ``kwplug.handlers``
entry points through discovery, registered as an Accelerator registers them.

pluggy's own implementation reads every installed distribution, ``ep.load()``-s each entry
point of the group and registers the raw object under the bare entry-point name: on kwplug's
manager that registered built-ins a second time (a handler *class* as ``"ddp"`` beside the
default instance ``"kwplug:ddp"``, or ``ValueError`` for a module registered already), let a
broken third-party plugin's exception reach the caller, and bypassed the loading controls, the
import guard (:mod:`kwplug._plugins._guard`) and a sandbox's isolation. :func:`load_handlers`
takes :func:`kwplug.discover`'s records instead and registers what the manager lacks with
:func:`kwplug._plugins._defaults.select`, the rule :meth:`~KwplugPluginManager.for_handlers`
uses. The manager's module cannot import this one (discovery imports the manager), so the
package's face hands it over (:func:`kwplug._plugins._manager.use_entry_point_loader`).
"""

from __future__ import annotations

from kwplug._plugins._defaults import select
from kwplug._plugins._discovery import discover
from kwplug._plugins._manager import KwplugPluginManager
from kwplug._plugins._records import plugin_object


def load_handlers(pm: KwplugPluginManager, name: str | None) -> int:
    """Register in ``pm`` the default plugins of :func:`kwplug.discover` that it lacks.

    Left out: what :func:`~kwplug._plugins._defaults.select` leaves out when ``pm``'s
    registered plugins stand for the user's handlers (a handler class with
    ``register_default`` false, or an instance of which is registered), an object registered
    already (by identity), a registered name, and a name blocked with pluggy's ``set_blocked``
    (the registered one, or the bare entry-point name pluggy's own loader would use).

    Args:
        pm: the manager to register into.
        name: only the entry point of this name, or of this registered name
            (``"<distribution>:<entry point>"``); ``None``: every one.

    Returns:
        The number of plugins registered.

    Raises:
        kwplug.errors.PluginLoadError: as :func:`kwplug.discover` (``KWPLUG_STRICT_PLUGINS``).
    """
    registered = pm.get_plugins()
    # Selected over every record, then narrowed to ``name``: the names and the built-in's
    # precedence over a third-party record naming the same object are then for_handlers' own.
    chosen = [
        d
        for d in select(discover(), lambda kind: any(isinstance(p, kind) for p in registered))
        if (name is None or name in (d.record.name, d.name))
        and d.record.obj not in registered
        and not pm.has_plugin(d.name)
        and not (pm.is_blocked(d.name) or pm.is_blocked(d.record.name))
    ]
    # In reverse precedence, as for_handlers: pluggy asks the last registered first.
    for d in reversed(chosen):
        pm.register_plugin(
            plugin_object(d.record), d.name, d.description, third_party=d.third_party
        )
    return len(chosen)

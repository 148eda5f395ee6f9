"""Discovery of handler plugins through the ``kwplug.handlers`` entry-point group.

Entry points are read with ``importlib-metadata`` once per process and cached. Each entry point
names either a :class:`~kwplug.KwargsHandler` subclass (kwplug registers a default instance of it
unless ``register_default`` is false) or any other pluggy plugin object, such as a module with
``@kwplug.hookimpl`` functions. A plugin that fails to import, to default-construct or to pass
pluggy's validation against the hook specs is reported (warning :class:`PluginLoadWarning`)
with its entry-point name, distribution, version and the reason; the others still load.

``KWPLUG_DISABLE_PLUGIN_AUTOLOAD=1`` loads only kwplug's own built-in handlers.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Iterable
from typing import Any

import attrs
import importlib_metadata
import pluggy

from kwplug.handler import KwargsHandler
from kwplug.hookspecs import PROJECT_NAME, HandlerSpec

GROUP = "kwplug.handlers"
DISABLE_AUTOLOAD_ENV = "KWPLUG_DISABLE_PLUGIN_AUTOLOAD"
_OWN_DISTRIBUTION = "kwplug"

logger = logging.getLogger(__name__)


class PluginLoadWarning(UserWarning):
    """A handler plugin could not be loaded; the message names it and says why."""


@attrs.frozen
class PluginRecord:
    """One discovered entry point of the ``kwplug.handlers`` group.

    Attributes:
        name: the entry-point name (e.g. ``"ddp"``).
        value: the entry-point target, ``"module:attr"``.
        distribution: name of the distribution that declares it (``"kwplug"`` for built-ins).
        version: that distribution's version.
        obj: the loaded object (handler class or plugin), or ``None`` when loading failed.
        error: why loading failed (``None`` when it loaded).
    """

    name: str
    value: str
    distribution: str
    version: str
    obj: Any = None
    error: str | None = None

    @property
    def builtin(self) -> bool:
        """True for kwplug's own built-in handlers."""
        return self.distribution == _OWN_DISTRIBUTION

    @property
    def loaded(self) -> bool:
        """True when the plugin imported and validated."""
        return self.error is None

    @property
    def handler_class(self) -> type[KwargsHandler] | None:
        """The handler class, when the entry point names a :class:`KwargsHandler` subclass."""
        obj = self.obj
        if isinstance(obj, type) and issubclass(obj, KwargsHandler):
            return obj
        return None

    def describe(self) -> str:
        """``name (distribution version)``, the way errors and warnings name a plugin."""
        return f"{self.name!r} ({self.distribution} {self.version})"


def new_plugin_manager() -> pluggy.PluginManager:
    """Return a ``pluggy.PluginManager`` for project ``kwplug`` with the hook specs added."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(HandlerSpec)
    return pm


def plugin_object(record: PluginRecord) -> Any:
    """What to register for a loaded record: a default handler instance, or the object itself."""
    cls = record.handler_class
    if cls is not None:
        return cls()
    return record.obj


def _load(ep: importlib_metadata.EntryPoint) -> PluginRecord:
    dist = ep.dist
    record = PluginRecord(
        name=ep.name,
        value=ep.value,
        distribution=dist.name if dist is not None else "<unknown>",
        version=dist.version if dist is not None else "<unknown>",
    )
    try:
        obj = ep.load()
        if isinstance(obj, type) and not issubclass(obj, KwargsHandler):
            raise TypeError(
                f"{ep.value} is a class but not a kwplug.KwargsHandler subclass; an entry point "
                "must name a KwargsHandler subclass or a plugin object (e.g. a module)"
            )
        if isinstance(obj, type) and not attrs.has(obj):
            raise TypeError(f"{ep.value} is not an attrs class (decorate it with @attrs.define)")
        # Validate hookimpls against the specs now, so a broken plugin is reported once here
        # instead of failing every Accelerator later.
        pm = new_plugin_manager()
        pm.register(plugin_object(attrs.evolve(record, obj=obj)))
        pm.check_pending()
    except Exception as exc:  # any failure of third-party code must not take kwplug down
        reason = f"{type(exc).__name__}: {exc}".strip()
        return attrs.evolve(record, error=reason)
    return attrs.evolve(record, obj=obj)


@functools.cache
def _discover_all() -> tuple[PluginRecord, ...]:
    seen: set[tuple[str, str]] = set()
    records: list[PluginRecord] = []
    for ep in importlib_metadata.entry_points(group=GROUP):
        dist_name = ep.dist.name if ep.dist is not None else ""
        if (dist_name, ep.name) in seen:  # the same distribution seen twice on sys.path
            continue
        seen.add((dist_name, ep.name))
        record = _load(ep)
        if record.error is not None:
            message = (
                f"kwplug: handler plugin {record.describe()} failed to load and is skipped: "
                f"{record.error}"
            )
            warnings.warn(message, PluginLoadWarning, stacklevel=3)
            logger.warning(message)
        records.append(record)
    return tuple(sorted(records, key=_order_key))


def _order_key(record: PluginRecord) -> tuple[bool, str, str]:
    # Third-party plugins first (by distribution, then entry-point name), built-ins last.
    return (record.builtin, record.distribution.lower(), record.name)


def discover(*, refresh: bool = False) -> tuple[PluginRecord, ...]:
    """Return the records of the ``kwplug.handlers`` entry points, in precedence order.

    Third-party plugins come first (sorted by distribution name, then entry-point name), then
    kwplug's built-ins. Failed plugins are included with ``error`` set. With
    ``KWPLUG_DISABLE_PLUGIN_AUTOLOAD=1`` only kwplug's own entry points are returned.

    Args:
        refresh: forget the per-process cache and read the entry points again (after a
            ``pip install`` in the same process).
    """
    if refresh:
        _discover_all.cache_clear()
    records = _discover_all()
    if os.environ.get(DISABLE_AUTOLOAD_ENV, "") not in ("", "0"):
        return tuple(r for r in records if r.builtin)
    return records


def loaded(records: Iterable[PluginRecord]) -> list[PluginRecord]:
    """The records that loaded successfully."""
    return [r for r in records if r.loaded]

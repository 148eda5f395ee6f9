"""What discovery knows about one entry point: :class:`PluginRecord`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from kwplug.handler import KwargsHandler

#: The distribution of kwplug's own built-in handlers.
OWN_DISTRIBUTION = "kwplug"
#: The entry-point group handler plugins are declared in.
GROUP = "kwplug.handlers"


@attrs.frozen
class PluginRecord:
    """One discovered entry point of the ``kwplug.handlers`` group.

    Attributes:
        name: the entry-point name (e.g. ``"ddp"``).
        value: the entry-point target, ``"module:attr"``.
        distribution: name of the distribution that declares it (``"kwplug"`` for built-ins).
        version: that distribution's version.
        obj: the loaded object (handler class or plugin), or ``None`` when not loaded.
        error: why loading failed (``None`` when it loaded or was not tried).
        status: ``"loaded"``, ``"failed"``, ``"incompatible"`` (its requirement on kwplug
            excludes this version; see :mod:`kwplug._plugins._api_range`), ``"blocked"``
            (``KWPLUG_BLOCK_PLUGINS``) or ``"disabled"`` (``KWPLUG_DISABLE_PLUGIN_AUTOLOAD``,
            ``KWPLUG_PLUGINS``).
        hooks: names of the hooks the plugin implements (empty when not loaded).
        load_seconds: wall time spent importing and validating it, in seconds.
        builtin: declared by the distribution this very kwplug was installed from (not merely
            by some metadata folder named ``kwplug``; see
            :func:`kwplug._plugins._own.is_own_distribution`).
    """

    name: str
    value: str
    distribution: str
    version: str
    obj: Any = None
    error: str | None = None
    status: str = "loaded"
    hooks: tuple[str, ...] = ()
    load_seconds: float = 0.0

    builtin: bool = False

    @property
    def source(self) -> str:
        """``"built-in"`` or ``"third-party"``."""
        return "built-in" if self.builtin else "third-party"

    @property
    def loaded(self) -> bool:
        """True when the plugin imported and validated."""
        return self.status == "loaded"

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


def plugin_object(record: PluginRecord) -> Any:
    """What to register for a loaded record: a default handler instance, or the object itself."""
    cls = record.handler_class
    if cls is not None:
        return cls()
    return record.obj


# The handler classes of the last discovery result asked about (the result is an immutable
# tuple of frozen records, so its classes never change).
_classes_of: tuple[tuple[PluginRecord, ...], tuple[type[KwargsHandler], ...]] = ((), ())


def register_defaults(records: tuple[PluginRecord, ...]) -> tuple[bool, ...]:
    """Each handler class's ``register_default`` in ``records``, in order: part of the keys
    under which a manager template and the set-up answers are kept (a class variable a script
    may change at any time, so it is read every time; which records hold a class is not)."""
    global _classes_of
    known, classes = _classes_of
    if known is not records:
        found = (r.handler_class for r in records)
        classes = tuple(cls for cls in found if cls is not None)
        _classes_of = (records, classes)
    return tuple([cls.register_default for cls in classes])


def loaded(records: Iterable[PluginRecord]) -> list[PluginRecord]:
    """The records that loaded successfully."""
    return [r for r in records if r.loaded]

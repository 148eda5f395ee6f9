"""Which discovered plugins a manager registers by default, and under which names.

One rule, shared by :meth:`~kwplug._plugins._manager.KwplugPluginManager.for_handlers` (an
Accelerator's manager) and by ``load_setuptools_entrypoints`` on any manager
(:mod:`kwplug._plugins._entrypoints`), so that both register the same objects under the same
names and descriptions: :func:`select`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs

from kwplug._plugins._records import PluginRecord, loaded
from kwplug.handler import KwargsHandler


@attrs.frozen
class Default:
    """One default plugin to register.

    Attributes:
        name: its registered name, ``"<distribution>:<entry point>"`` (a third-party plugin
            whose name a built-in or another plugin holds gets a ``#third-party`` suffix).
        description: how messages name it, ``"default plugin 'ddp' (kwplug 0.1.0)"``.
        record: its discovery record (``plugin_object(record)`` is what to register).
    """

    name: str
    description: str
    record: PluginRecord

    @property
    def third_party(self) -> bool:
        """Whether it is a third-party plugin (not one of kwplug's built-ins)."""
        return not self.record.builtin


def select(
    records: Iterable[PluginRecord], present: Callable[[type[KwargsHandler]], bool]
) -> list[Default]:
    """The default plugins of ``records``, in precedence order (register them in reverse:
    pluggy asks the most recently registered implementation first).

    A handler class is left out when its ``register_default`` is false or ``present(cls)``
    says an instance of it (or of a subclass, which replaces it) is there already. An object
    named by several entry points is selected once (by identity; a built-in's record wins
    over a third-party one naming the same class or module).

    Args:
        records: discovered plugins in precedence order (:func:`kwplug.discover`); only the
            loaded ones are considered.
        present: whether the manager has (or will have) an instance of a handler class.

    Returns:
        One :class:`Default` per object to register, most important first.
    """
    usable = loaded(records)
    # Registered by identity, once: two entry points may name one class or module (a
    # checkout's kwplug.egg-info on sys.path declares every built-in again, as a third-party
    # "kwplug"), and pluggy refuses a second registration of one object or of one name. The
    # built-in's record wins, so the object keeps its built-in name and standing; the clash
    # itself is reported by discovery.
    builtin_objects = {id(r.obj) for r in usable if r.builtin}
    names = {f"{r.distribution}:{r.name}" for r in usable if r.builtin}
    seen: set[int] = set()
    found: list[Default] = []
    for r in usable:
        handler_class = r.handler_class
        if id(r.obj) in seen or (not r.builtin and id(r.obj) in builtin_objects):
            continue
        if handler_class is not None and (
            not handler_class.register_default or present(handler_class)
        ):
            continue
        seen.add(id(r.obj))
        name = f"{r.distribution}:{r.name}"
        if not r.builtin:
            name = _unique(name, names)
            names.add(name)
        found.append(Default(name, f"default plugin {r.describe()}", r))
    return found


def _unique(name: str, taken: set[str]) -> str:
    # A third-party plugin whose "distribution:name" is a built-in's (a foreign metadata
    # folder named kwplug) or another's gets a suffix instead of crashing pluggy.
    if name not in taken:
        return name
    candidate, n = f"{name}#third-party", 2
    while candidate in taken:
        candidate, n = f"{name}#third-party-{n}", n + 1
    return candidate

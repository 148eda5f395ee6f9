"""pluggy's registry by object identity, for plugins that compare by value and do not hash.

A kwplug handler is a pluggy plugin *and* an attrs class that compares by value and is
unhashable, as Accelerate's dataclass handlers are (``DistributedDataParallelKwargs() ==
DistributedDataParallelKwargs()``; ``hash(...)`` raises ``TypeError``). pluggy assumes
plugins are hashable and tells them apart with ``==``: ``get_plugins()`` builds a ``set``
(``TypeError: unhashable type``), ``is_registered``/``get_name`` call an equal copy
registered (and ``unregister(copy)`` then fails with "do not agree"), ``register`` refuses a
second handler equal to one already registered ("already registered under a different
name") and ``subset_hook_caller`` builds a ``set`` of the plugins to leave out.

:class:`~kwplug._plugins._manager.KwplugPluginManager` answers these by identity instead, as
pluggy itself does where it matches implementations to plugins (``impl.plugin is plugin``):

- :class:`Registry` is the manager's ``_name2plugin``: a ``dict`` whose ``values()`` view
  tests membership by identity, which is the test ``register`` makes;
- :class:`PluginSet` is what ``get_plugins()`` returns: a read-only
  :class:`collections.abc.Set` holding the registered objects (hashable or not), membership
  by identity, in registration order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, ValuesView
from collections.abc import Set as AbstractSet
from typing import Any


class PluginSet(AbstractSet[Any]):
    """A read-only set of plugin objects whose membership is identity (``x is plugin``).

    Supports what code does with pluggy's ``get_plugins()``: ``in``, iteration (registration
    order), ``len``, and the set operators with other sets (``-``, ``&``, ``|``, ``<=``, ...),
    for plugins that are hashable or not. Two plugin sets are equal when they hold the same
    objects. ``set(pm.get_plugins())`` still needs hashable plugins, as any ``set`` does.
    """

    __slots__ = ("_objects",)

    def __init__(self, objects: Iterable[Any] = ()) -> None:
        """The distinct (by identity) objects of ``objects``, in order."""
        kept: dict[int, Any] = {}
        for obj in objects:
            kept.setdefault(id(obj), obj)
        self._objects = kept

    @classmethod
    def _from_iterable(cls, it: Iterable[Any]) -> PluginSet:
        # What collections.abc.Set's operators build their results with.
        return cls(it)

    def __contains__(self, obj: object) -> bool:
        return self._objects.get(id(obj), _ABSENT) is obj

    def __iter__(self) -> Iterator[Any]:
        return iter(self._objects.values())

    def __len__(self) -> int:
        return len(self._objects)

    def __repr__(self) -> str:
        return f"PluginSet({list(self._objects.values())!r})"

    # collections.abc.Set defines ``__eq__``, which makes the class unhashable; it stays so
    # (a set that compares by content must not hash by identity).
    __hash__ = None  # type: ignore[assignment]


_ABSENT = object()


class _IdentityValues(ValuesView[Any]):
    # dict.values() with ``in`` by identity; iteration and len are the dict's own.
    _mapping: dict[str, Any]

    def __contains__(self, obj: object) -> bool:
        return any(value is obj for value in dict.values(self._mapping))

    def __iter__(self) -> Iterator[Any]:
        return iter(dict.values(self._mapping))


class Registry(dict[str, Any]):
    """The manager's name -> plugin ``dict`` (pluggy's ``_name2plugin``; ``None`` marks a
    blocked name), whose ``values()`` tests membership by identity so that pluggy's
    ``register`` refuses the *same* object twice but accepts an equal one."""

    __slots__ = ()

    def values(self) -> _IdentityValues:  # type: ignore[override]
        """The registered objects; ``obj in registry.values()`` means ``obj is`` one."""
        return _IdentityValues(self)

    def name_of(self, plugin: object) -> str | None:
        """The name ``plugin`` (this very object) is registered under, else ``None``."""
        for name, value in self.items():
            if value is plugin:
                return name
        return None

"""Default objects built once and copied: :class:`Pristine`.

Every ``Accelerator()`` builds the same default objects again: a default instance of each
discovered handler class the user did not pass (``kwplug._plugins._reuse``) and its default
option objects (``ProjectConfiguration()``, ...). Building one runs its attrs converters and
validators -- and, for some fields, reads of ``os.environ`` (``TorchDynamoPlugin``'s
``ACCELERATE_DYNAMO_*``) -- about half of a repeated construction's cost (issue 31, goal 3).
The result is the same every time for the same class, arguments and environment, so a
:class:`Pristine` keeps one instance per (class, arguments) and hands out copies of it: a new
object of the class with the same field values, set without running ``__init__``,
converters, validators or ``__attrs_post_init__`` again.

What makes a copy the same as a new construction, and so what is copied at all:

- the class is kwplug's own (its module is ``kwplug`` or under it) and an attrs class: its
  construction is known to depend on nothing but its arguments and ``os.environ``, and to have
  no side effect (a third-party handler's ``__init__`` might count instances or read a file:
  it is always constructed);
- every field holds an immutable plain value (``None``, numbers, strings, enums, time spans,
  and tuples or frozensets of them), shared by the copies, or a list, dict or set of such
  values, which each copy gets its own copy of (so that changing one Accelerator's handler
  in place never reaches another's); nothing else is set on the instance (no other slot, no
  other ``__dict__`` entry);
- the environment (``os.environ``, compared whole, as ``kwplug.accelerator._setup_cache``
  does) is what it was when the instance was built: :meth:`Pristine.check` forgets every kept
  instance when it changed. The caller calls it once per construction, before its
  :meth:`Pristine.new` calls (one comparison instead of one per object). A store made with
  ``environ=False`` is for classes whose construction reads nothing but its arguments (the
  option objects) and needs no check.

Anything else is constructed as before, every time. On a Python whose ``os.environ`` keeps
the environment elsewhere than CPython's ``_data`` dict, nothing is kept.
"""

from __future__ import annotations

import datetime
import enum
import threading
import types
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from kwplug._contracts import environ

T = TypeVar("T")

# Values a copy shares with the kept instance: immutable, so sharing is not observable.
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, enum.Enum, datetime.timedelta)
# Containers a copy gets its own (shallow) copy of; their items must be immutable.
_CONTAINERS = (list, dict, set)


def _immutable(value: Any) -> bool:
    if isinstance(value, _IMMUTABLE):
        return True
    if type(value) in (tuple, frozenset):
        return all(_immutable(item) for item in value)
    return False


def _copyable(value: Any) -> bool:
    # A list, dict or set (exactly: a subclass may copy differently) of immutable values.
    if type(value) is dict:
        return all(_immutable(k) and _immutable(v) for k, v in value.items())
    return type(value) in _CONTAINERS and all(_immutable(item) for item in value)


def _slot_setters(cls: type) -> dict[str, Callable[[Any, Any], None]] | None:
    # Each slot's member descriptor's setter (a C call, past attrs' on_setattr hooks and
    # faster than object.__setattr__ by name), or None for a class with a __dict__ (attrs'
    # slotted classes have none; a class that has one is built every time).
    setters: dict[str, Callable[[Any, Any], None]] = {}
    for klass in reversed(cls.__mro__):
        slots = vars(klass).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name == "__dict__":
                return None
            descriptor = vars(klass).get(name)
            if isinstance(descriptor, types.MemberDescriptorType):
                setters[name] = descriptor.__set__
    return setters


def copier(instance: T) -> Callable[[], T] | None:
    """A function returning a new object equal to ``instance``, field by field, without
    running its construction again; ``None`` when such a copy could differ from a new
    construction (see the module docstring: not kwplug's own slotted attrs class, a field
    holding another kind of value, a slot set outside the fields).

    Args:
        instance: a freshly constructed object, never changed since.
    """
    cls: type[T] = type(instance)
    kind = type(instance)  # (narrowed to an attrs class below; cls stays the instance's type)
    module = getattr(cls, "__module__", "") or ""
    if not (module == "kwplug" or module.startswith("kwplug.")) or not attrs.has(kind):
        return None
    setters = _slot_setters(cls)
    if setters is None:
        return None
    names = [field.name for field in attrs.fields(kind)]
    # State outside the fields would not be copied: refuse rather than drop it.
    for slot in set(setters) - set(names) - {"__weakref__"}:
        if hasattr(instance, slot):
            return None
    shared: list[tuple[Callable[[Any, Any], None], Any]] = []
    copied: list[tuple[Callable[[Any, Any], None], Any]] = []
    for name in names:
        if name not in setters:
            return None
        try:
            value = getattr(instance, name)
        except AttributeError:  # an init=False field without a default: left unset too
            continue
        if _immutable(value):
            shared.append((setters[name], value))
        elif _copyable(value):
            # A copy of its own, not the instance's (which is handed out and may change).
            copied.append((setters[name], value.copy()))
        else:
            return None
    new = object.__new__
    shared_items, copied_items = tuple(shared), tuple(copied)

    def copy() -> T:
        twin = new(cls)
        for set_field, value in shared_items:
            set_field(twin, value)
        for set_field, value in copied_items:
            set_field(twin, value.copy())
        return twin

    # The copy must equal the instance (attrs' __eq__); a class comparing otherwise is built.
    return copy if copy() == instance else None


class Pristine:
    """Objects built once per (class, arguments) under the current environment, handed out as
    copies (:func:`copier`); objects that cannot be copied faithfully are built every time.

    Threads: a kept instance is only ever read, and two threads missing at once both build
    one. An instance is kept only when the environment :meth:`check` recorded before it was
    built is still the recorded one, and equal to ``os.environ``, afterwards; that test and
    the insertion are one step under a lock that :meth:`check` also takes, so another
    thread's change of the environment (and its ``check``) during the construction means the
    instance is not kept.
    """

    __slots__ = ("_environ", "_lock", "_makers", "_watch")

    #: Kept (class, arguments) combinations; all are forgotten past it.
    MAX_KEPT = 64

    def __init__(self, *, environ: bool = True) -> None:
        """An empty store.

        Args:
            environ: the objects' construction reads ``os.environ`` (default): they are kept
                only while it stays the same, and :meth:`check` must be called once per
                construction. ``False``: it reads nothing but the arguments (option objects),
                and :meth:`check` is not needed.
        """
        self._watch = environ
        self._lock = threading.Lock()
        self._environ: dict[Any, Any] | None = None
        # (class, arguments) -> a copier, or None: build this one every time.
        self._makers: dict[tuple[Any, ...], Callable[[], Any] | None] = {}

    def check(self) -> bool:
        """Forget every kept object if ``os.environ`` changed since they were built; call it
        once per construction, before :meth:`new`.

        Returns:
            Whether copies may be handed out (``False`` on a Python without ``os.environ``'s
            ``_data``: :meth:`new` then always constructs).
        """
        if not self._watch:
            return True
        data = environ.data()
        with self._lock:
            if data is None:
                self._makers.clear()
                return False
            if data != self._environ:
                self._makers.clear()
                self._environ = dict(data)
        return True

    def new(self, cls: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A copy of the kept ``cls(*args, **kwargs)``, or a new one (kept when copyable and
        the environment is still the one :meth:`check` saw).

        Args:
            cls: the class (called with the arguments when nothing is kept).
            args: positional arguments; part of the key with their types (``1`` and
                ``True`` are different keys), so an unhashable one means no copy.
            kwargs: keyword arguments, likewise.

        Raises:
            Exception: whatever ``cls(*args, **kwargs)`` raises (nothing is kept then).
        """
        key: tuple[Any, ...] = (cls,)
        if args:
            key += tuple([(type(v), v) for v in args])
        if kwargs:
            key += tuple([(k, type(v), v) for k, v in kwargs.items()])
        try:
            maker = self._makers.get(key)
        except TypeError:  # an unhashable argument: nothing to look up
            return cls(*args, **kwargs)
        if maker is not None:
            return maker()  # type: ignore[no-any-return]
        seen = self._environ  # the environment recorded before this construction
        instance = cls(*args, **kwargs)
        make = copier(instance)
        with self._lock:
            if key not in self._makers and self._still(seen):
                if len(self._makers) >= self.MAX_KEPT:
                    self._makers.clear()
                self._makers[key] = make
        return instance

    def each(self, classes: tuple[type, ...]) -> list[Any]:
        """``[self.new(cls) for cls in classes]`` (no arguments), in one call: an Accelerator's
        manager copy asks for every default handler at once.

        Raises:
            Exception: whatever a class's construction raises.
        """
        makers = self._makers
        out = []
        for cls in classes:
            maker = makers.get((cls,))  # new()'s key for a class called without arguments
            out.append(maker() if maker is not None else self.new(cls))
        return out

    def _still(self, seen: dict[Any, Any] | None) -> bool:
        # Whether an object built just now was built in the environment recorded before it
        # (another thread may have changed os.environ, and recorded it, since): only then may
        # it stand for that environment. Called under the lock.
        if not self._watch:
            return True
        return seen is not None and self._environ is seen and environ.data() == seen

    def clear(self) -> None:
        """Forget every kept object."""
        with self._lock:
            self._makers.clear()
            self._environ = None

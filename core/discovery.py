"""Discovery of handler plugins through the ``kwplug.handlers`` entry-point group.

Entry points are read with ``importlib-metadata`` once per process and cached. Each entry point
names either a :class:`~kwplug.KwargsHandler` subclass (kwplug registers a default instance of it
unless ``register_default`` is false) or any other pluggy plugin object, such as a module with
``@kwplug.hookimpl`` functions. A plugin that fails to import, to default-construct or to pass
pluggy's validation against the hook specs is reported (warning :class:`PluginLoadWarning`)
with its entry-point name, distribution, version and the reason; the others still load.

Which plugins are imported at all is governed by the loading controls of
:mod:`kwplug.loading` (``KWPLUG_DISABLE_PLUGIN_AUTOLOAD``, ``KWPLUG_PLUGINS``,
``KWPLUG_BLOCK_PLUGINS``, ``KWPLUG_STRICT_PLUGINS``); a blocked or disabled plugin is listed but
never imported.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterable
from typing import Any, cast

import attrs
import importlib_metadata
import pluggy

from kwplug.compat import api_problem
from kwplug.conflicts import device_types_problem
from kwplug.handler import KwargsHandler
from kwplug.hookspecs import PROJECT_NAME, HandlerSpec
from kwplug.loading import LoadControls, PluginLoadError, PluginLoadWarning

GROUP = "kwplug.handlers"
#: A plugin slower than this to import (seconds) is reported with a PluginLoadWarning.
SLOW_IMPORT_SECONDS = 1.0
_OWN_DISTRIBUTION = "kwplug"

logger = logging.getLogger(__name__)


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
            excludes this version; see :mod:`kwplug.compat`), ``"blocked"``
            (``KWPLUG_BLOCK_PLUGINS``) or ``"disabled"`` (``KWPLUG_DISABLE_PLUGIN_AUTOLOAD``,
            ``KWPLUG_PLUGINS``).
        hooks: names of the hooks the plugin implements (empty when not loaded).
        load_seconds: wall time spent importing and validating it, in seconds.
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

    @property
    def source(self) -> str:
        """``"built-in"`` or ``"third-party"``."""
        return "built-in" if self.builtin else "third-party"

    @property
    def builtin(self) -> bool:
        """True for kwplug's own built-in handlers."""
        return self.distribution == _OWN_DISTRIBUTION

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


_NO_OPTS: Any = object()


class KwplugPluginManager(pluggy.PluginManager):
    """``pluggy.PluginManager`` that remembers, per handler class, which attributes are hook
    implementations.

    pluggy inspects every attribute of a plugin at each ``register`` (``inspect.getattr_static``
    over the ~50 attributes of an attrs class); an Accelerator registers a handler of each class,
    so the answer is cached per class. Attributes set on an instance (not the class) are not
    cached.
    """

    _opts_cache: dict[tuple[Any, str], Any] = {}  # noqa: RUF012 - shared on purpose

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> pluggy.HookimplOpts | None:
        """pluggy's answer, cached per (class, attribute) for instances and per (module,
        attribute) for modules."""
        key: tuple[Any, str]
        if isinstance(plugin, types.ModuleType):
            key = (plugin, name)  # a module plugin: its functions are fixed once imported
        elif isinstance(plugin, type) or name in getattr(plugin, "__dict__", ()):
            return super().parse_hookimpl_opts(plugin, name)
        else:
            key = (type(plugin), name)
        opts = self._opts_cache.get(key, _NO_OPTS)
        if opts is _NO_OPTS:
            opts = super().parse_hookimpl_opts(plugin, name)
            self._opts_cache[key] = opts
        return None if opts is None else cast(pluggy.HookimplOpts, dict(opts))


def new_plugin_manager() -> pluggy.PluginManager:
    """Return a :class:`KwplugPluginManager` for project ``kwplug`` with the hook specs added."""
    pm = KwplugPluginManager(PROJECT_NAME)
    pm.add_hookspecs(HandlerSpec)
    return pm


def tryfirst_problem(pm: pluggy.PluginManager, plugin: Any) -> str | None:
    """Why ``plugin`` may not be loaded as is: a hook implementation marked ``tryfirst``
    would answer before the handlers the user passes (kwplug decides the order), or ``None``."""
    names = sorted(
        caller.name
        for caller in pm.get_hookcallers(plugin) or ()
        for impl in caller.get_hookimpls()
        if impl.plugin is plugin and impl.tryfirst
    )
    if not names:
        return None
    return (
        f"hook implementation(s) {', '.join(names)} marked tryfirst would answer before the "
        "user's kwargs_handlers; remove tryfirst (kwplug orders plugins: user handlers, "
        "third-party defaults, built-ins)"
    )


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
    start = time.perf_counter()
    try:
        obj = ep.load()
        if isinstance(obj, type) and not issubclass(obj, KwargsHandler):
            raise TypeError(
                f"{ep.value} is a class but not a kwplug.KwargsHandler subclass; an entry point "
                "must name a KwargsHandler subclass or a plugin object (e.g. a module)"
            )
        if isinstance(obj, type) and issubclass(obj, KwargsHandler) and not obj.is_attrs_class():
            raise TypeError(f"{ep.value} is not an attrs class (decorate it with @attrs.define)")
        # Validate hookimpls against the specs now, so a broken plugin is reported once here
        # instead of failing every Accelerator later.
        pm = new_plugin_manager()
        plugin = plugin_object(attrs.evolve(record, obj=obj))
        pm.register(plugin, name=ep.name)
        pm.check_pending()
        problem = device_types_problem(plugin) or tryfirst_problem(pm, plugin)
        if problem is not None:
            raise TypeError(problem)
        hooks = tuple(sorted(c.name for c in pm.get_hookcallers(plugin) or ()))
    except Exception as exc:  # any failure of third-party code must not take kwplug down
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line, for tables
        return attrs.evolve(
            record, error=reason, status="failed", load_seconds=time.perf_counter() - start
        )
    return attrs.evolve(record, obj=obj, hooks=hooks, load_seconds=time.perf_counter() - start)


_visible: Callable[[importlib_metadata.EntryPoint], bool] | None = None


def set_visible(visible: Callable[[importlib_metadata.EntryPoint], bool] | None) -> None:
    """Restrict discovery to the entry points ``visible`` accepts (``None``: all of them),
    and forget the caches. Used by :class:`kwplug.testing.PluginSandbox` to isolate tests from
    whatever else is installed."""
    global _visible
    _visible = visible
    discover(refresh=True)


@functools.cache
def _entry_points() -> tuple[importlib_metadata.EntryPoint, ...]:
    # Reading metadata is cheap; importing plugins is not, so loading is separate (and skipped
    # for third-party plugins when autoload is disabled).
    seen: set[tuple[str, str]] = set()
    found = []
    for ep in importlib_metadata.entry_points(group=GROUP):
        key = (ep.dist.name if ep.dist is not None else "", ep.name)
        if key not in seen:  # the same distribution can be seen twice on sys.path
            seen.add(key)
            found.append(ep)
    return tuple(found)


@functools.cache
def _load_cached(ep: importlib_metadata.EntryPoint) -> PluginRecord:
    record = _load(ep)
    if record.error is not None:
        message = (
            f"kwplug: handler plugin {record.describe()} failed to load and is skipped: "
            f"{record.error}"
        )
        _warn(message)
    elif record.load_seconds > SLOW_IMPORT_SECONDS:
        message = (
            f"kwplug: handler plugin {record.describe()} took {record.load_seconds:.1f} s to "
            "import; every process pays this at start-up"
        )
        _warn(message)
    return record


_CORE = os.path.dirname(os.path.abspath(__file__))


def _warn(message: str) -> None:
    # Point the warning at the user's line (the Accelerator(), the discover() call), not at
    # kwplug's own frames, whatever depth the cached loaders are reached from.
    frame = sys._getframe(1)
    level = 2
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_CORE):
        frame = frame.f_back
        level += 1
    warnings.warn(message, PluginLoadWarning, stacklevel=level)
    logger.debug(message)


@functools.cache
def _incompatible(ep: importlib_metadata.EntryPoint, problem: str) -> PluginRecord:
    distribution, version = _dist(ep)
    record = PluginRecord(
        ep.name, ep.value, distribution, version, error=problem, status="incompatible"
    )
    message = f"kwplug: handler plugin {record.describe()} is not loaded: {problem}"
    _warn(message)
    return record


def _dist(ep: importlib_metadata.EntryPoint) -> tuple[str, str]:
    if ep.dist is None:
        return "<unknown>", "<unknown>"
    return ep.dist.name, ep.dist.version


def _order_key(record: PluginRecord) -> tuple[bool, str, str]:
    # Third-party plugins first (by distribution, then entry-point name), built-ins last.
    return (record.builtin, record.distribution.lower(), record.name)


@functools.cache
def _warn_unknown_once(controls: LoadControls, known: tuple[tuple[str, str], ...]) -> None:
    controls.warn_unknown(known)


def discover(*, refresh: bool = False) -> tuple[PluginRecord, ...]:
    """Return the records of the ``kwplug.handlers`` entry points, in precedence order.

    Third-party plugins come first (sorted by distribution name, then entry-point name), then
    kwplug's built-ins; the order does not depend on the order entry points are found in.
    Every entry point is listed with its ``status``; only ``"loaded"`` ones take part in
    hook calls. A failed plugin is reported once per process with a
    :class:`~kwplug.loading.PluginLoadWarning`; blocked and disabled plugins are not imported.

    Args:
        refresh: forget the per-process cache and read the entry points again (after a
            ``pip install`` in the same process).

    Raises:
        PluginLoadError: a plugin failed to load and ``KWPLUG_STRICT_PLUGINS=1``.
    """
    if refresh:
        _entry_points.cache_clear()
        _load_cached.cache_clear()
        _incompatible.cache_clear()
        _discover.cache_clear()
    return _discover(LoadControls.from_env())


@functools.cache
def _discover(controls: LoadControls) -> tuple[PluginRecord, ...]:
    # Cached per set of controls: reading distribution metadata is the costly part, and the
    # environment variables may change between calls (tests, notebooks).
    records = []
    for ep in _entry_points():
        if _visible is not None and not _visible(ep):
            continue
        distribution, version = _dist(ep)
        builtin = distribution == _OWN_DISTRIBUTION
        status = controls.status(ep.name, distribution, builtin)
        problem = None if builtin or status is not None else api_problem(ep.dist)
        if problem is not None:  # never imported: an incompatible plugin is not half-loaded
            records.append(_incompatible(ep, problem))
        elif status is None:
            records.append(_load_cached(ep))
        else:
            records.append(PluginRecord(ep.name, ep.value, distribution, version, status=status))
    if controls.allow or controls.block:
        _warn_unknown_once(controls, tuple(sorted((r.name, r.distribution) for r in records)))
    if controls.strict:
        failed = [r for r in records if r.status in ("failed", "incompatible")]
        if failed:
            _discover.cache_clear()  # raise again next time
            raise PluginLoadError(
                "KWPLUG_STRICT_PLUGINS is set and handler plugin(s) failed to load: "
                + "; ".join(f"{r.describe()}: {r.error}" for r in failed)
            )
    return tuple(sorted(records, key=_order_key))


def loaded(records: Iterable[PluginRecord]) -> list[PluginRecord]:
    """The records that loaded successfully."""
    return [r for r in records if r.loaded]

"""Discovery of handler plugins through the ``kwplug.handlers`` entry-point group.

Entry points are read with ``importlib-metadata`` once per environment: the result is kept in
memory for the process and on disk across processes (:mod:`kwplug._plugins._cache`, validated
against ``sys.path`` and the plugins' metadata times at each start). Each entry point
names either a :class:`~kwplug.KwargsHandler` subclass (kwplug registers a default instance of it
unless ``register_default`` is false) or any other pluggy plugin object, such as a module with
``@kwplug.hookimpl`` functions. A plugin that fails to import, to default-construct or to pass
pluggy's validation against the hook specs is reported (warning :class:`PluginLoadWarning`)
with its entry-point name, distribution, version and the reason; the others still load.

Which plugins are imported at all is governed by the loading controls of
:mod:`kwplug._plugins._controls` (``KWPLUG_DISABLE_PLUGIN_AUTOLOAD``, ``KWPLUG_PLUGINS``,
``KWPLUG_BLOCK_PLUGINS``, ``KWPLUG_STRICT_PLUGINS``); a blocked or disabled plugin is listed but
never imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import attrs

from kwplug._plugins import _cache
from kwplug._plugins._cache import CachedDistribution, CachedEntryPoint, EntryPointLike
from kwplug._plugins._clashes import warn_clashes
from kwplug._plugins._controls import LoadControls
from kwplug._plugins._guard import kwplug_kept, preload
from kwplug._plugins._manager import KwplugPluginManager
from kwplug._plugins._own import is_own_distribution, normalise
from kwplug._plugins._records import GROUP, PluginRecord, plugin_object
from kwplug._plugins._rules import (
    entry_point_object_problem,
    registered_plugin_problem,
    validate_hookimpls,
)
from kwplug._plugins._watched import expect_plugins, watch_plugin
from kwplug.errors import PluginLoadError, PluginLoadWarning, user_stacklevel

#: A plugin slower than this to import (seconds) is reported with a PluginLoadWarning.
SLOW_IMPORT_SECONDS = 1.0
#: A plugin import still running after this many seconds is logged (level WARNING, logger
#: ``kwplug.discovery``) while it runs, naming the plugin: a hang says which plugin hangs.
HUNG_IMPORT_SECONDS = 5.0

# The public logger name (documented), kept from when this was the module kwplug.discovery.
logger = logging.getLogger("kwplug.discovery")


#: Called with a plugin's record just before its import (``listen_imports``).
_import_listeners: list[Callable[[PluginRecord], None]] = []


def listen_imports(listener: Callable[[PluginRecord], None]) -> None:
    """Call ``listener(record)`` before each plugin's import from now on: ``kwplug plugins``
    runs discovery in a child process that reports, through it, the plugin whose import
    ended the process (``os._exit`` cannot be caught)."""
    _import_listeners.append(listener)


def _load(ep: EntryPointLike) -> PluginRecord:
    distribution, version = _dist(ep)
    record = PluginRecord(ep.name, ep.value, distribution, version, builtin=_builtin(ep))
    for listener in _import_listeners:
        listener(record)
    _import_torch()  # not timed: load_seconds is the plugin's own import
    if not record.builtin:
        preload()  # every core module in the guard's snapshot (not timed either)
    start = time.perf_counter()
    # An import cannot be interrupted from Python, so a hung plugin cannot be skipped; but it
    # is named while it hangs (from a timer thread) instead of leaving a silent process.
    watchdog = threading.Timer(HUNG_IMPORT_SECONDS, _report_hung, args=(record,))
    watchdog.daemon = True
    watchdog.start()
    # A third-party import cannot change kwplug: what it replaced is restored and reported
    # (built-ins were imported before any third-party plugin, see _discover).
    changes: list[str] = []
    guard = contextlib.nullcontext(changes) if record.builtin else kwplug_kept(_top(ep))
    try:
        with guard as changes:
            obj, hooks = _import_and_check(ep, record)
        if changes:
            raise _ChangedKwplug
    except KeyboardInterrupt:  # the user's Ctrl-C stops the program, as everywhere else
        raise
    except BaseException as exc:  # a plugin's SystemExit must not end the run
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line, for tables
        if changes:
            changed = f"its import changed kwplug ({', '.join(changes)}); kwplug undid the changes"
            reason = changed if isinstance(exc, _ChangedKwplug) else f"{changed}; then {reason}"
        return attrs.evolve(
            record, error=reason, status="failed", load_seconds=time.perf_counter() - start
        )
    finally:
        watchdog.cancel()
    if not record.builtin:
        watch_plugin(obj)  # a later plugin's import cannot patch this one silently
    return attrs.evolve(record, obj=obj, hooks=hooks, load_seconds=time.perf_counter() - start)


def _top(ep: EntryPointLike) -> str:
    # The top-level module an entry point imports ("pkg" of "pkg.mod:Class").
    return ep.value.partition(":")[0].strip().partition(".")[0]


def _import_torch() -> None:
    # kwplug's own dependency, which nearly every plugin imports: paid once by whoever comes
    # first, it would be reported as that plugin's import time (seconds) -- by `kwplug
    # plugins`, which has not imported torch yet, though a training script has. Imported
    # before the first plugin instead, so the slow-import warning measures the plugin.
    if "torch" not in sys.modules:
        import torch  # noqa: F401


class _ChangedKwplug(Exception):
    """A third-party import changed kwplug (the changes are listed by the guard)."""


def _import_and_check(ep: EntryPointLike, record: PluginRecord) -> tuple[Any, tuple[str, ...]]:
    # The loaded object and the hooks it implements; raises whatever import or validation does.
    obj = ep.load()
    problem = entry_point_object_problem(obj, ep.value)
    if problem is not None:
        raise TypeError(problem)
    # Validate hookimpls against the specs now, so a broken plugin is reported once here
    # instead of failing every Accelerator later.
    pm = _checker()
    plugin = plugin_object(attrs.evolve(record, obj=obj))
    with _checker_lock:
        try:
            validate_hookimpls(pm, plugin, ep.name)
            problem = registered_plugin_problem(pm, plugin)
            if problem is not None:
                raise TypeError(problem)
            hooks = tuple(sorted(c.name for c in pm.get_hookcallers(plugin) or ()))
        finally:
            if pm.is_registered(plugin):
                pm.unregister(plugin)
    return obj, hooks


@functools.cache
def _checker() -> KwplugPluginManager:
    # One manager validates every plugin in turn (registered, checked, unregistered): building
    # one per plugin costs the hook specs' inspection each time.
    return KwplugPluginManager()


def _report_hung(record: PluginRecord) -> None:
    # Runs on the watchdog thread: logging is thread-safe (warnings' filters are not), and
    # without any logging configuration a WARNING still reaches stderr (logging.lastResort).
    logger.warning(
        "kwplug: still importing handler plugin %s (%s) after %.0f s; an import cannot be "
        "interrupted: if it hangs, block it with KWPLUG_BLOCK_PLUGINS=%s:%s",
        record.describe(),
        record.value,
        HUNG_IMPORT_SECONDS,
        record.distribution,
        record.name,
    )


_checker_lock = threading.Lock()
_visible: Callable[[EntryPointLike], bool] | None = None


def set_visible(visible: Callable[[EntryPointLike], bool] | None) -> None:
    """Restrict discovery to the entry points ``visible`` accepts (``None``: all of them),
    and forget the caches. Used by :class:`kwplug.testing.PluginSandbox` to isolate tests from
    whatever else is installed. Nothing is discovered here: the next :func:`discover` does it,
    so leaving a sandbox neither imports what is installed outside it nor raises or warns
    about it (``KWPLUG_STRICT_PLUGINS``) until something outside uses discovery."""
    global _visible
    _visible = visible
    _forget()


def _forget() -> None:
    _entry_points.cache_clear()
    _load_cached.cache_clear()
    _incompatible.cache_clear()
    _discover.cache_clear()


def visible() -> Callable[[EntryPointLike], bool] | None:
    """The filter :func:`set_visible` installed (``None``: every entry point)."""
    return _visible


@functools.cache
def _entry_points() -> tuple[EntryPointLike, ...]:
    # Reading metadata costs tens of milliseconds; importing plugins is separate (and skipped
    # for third-party plugins when autoload is disabled).
    if not _cache.enabled():
        return tuple(_scan())
    key = _cache.environment_key()
    cached = _cache.read(key)
    if cached is not None:
        return cached
    found = _scan()
    if LoadControls.from_env().builtins_only:
        # Filling the cache range-checks every plugin (importing packaging); this process
        # loads none, so it leaves that to the next one that may.
        return tuple(found)
    entries = tuple(_cached(ep) for ep in found)
    folders = [ep.dist.path for ep in entries]
    if all(folders):  # else a zip or a custom finder
        _cache.write(key, entries, (f for f in folders if f))
    return entries


def _scan() -> list[EntryPointLike]:
    import importlib_metadata  # only on a cache miss: importing it costs milliseconds

    # importlib_metadata remembers each folder's listing by its modification time, blind where
    # a build normalises times (as the cache's stamps are not): a scan reads the disk anew.
    importlib.invalidate_caches()

    # Every distribution, not importlib_metadata.entry_points(): that keeps only the first
    # distribution of each name on sys.path, so a foreign metadata folder named kwplug placed
    # first would hide kwplug's own built-ins.
    seen: set[tuple[str, str, bool]] = set()
    found: list[EntryPointLike] = []
    for dist in importlib_metadata.distributions():
        builtin = is_own_distribution(dist)
        for ep in dist.entry_points.select(group=GROUP):
            key = (normalise(dist.name), ep.name, builtin)
            if key not in seen:  # the same distribution can be seen twice on sys.path
                seen.add(key)
                found.append(ep)
    return found


def _cached(ep: EntryPointLike) -> CachedEntryPoint:
    distribution, version = _dist(ep)
    builtin = _builtin(ep)
    problem = None if builtin else _api_problem(ep)
    folder = getattr(ep.dist, "_path", None)
    path = os.fspath(folder) if isinstance(folder, os.PathLike) else None
    return CachedEntryPoint(
        ep.name, ep.value, CachedDistribution(distribution, version, problem, builtin, path)
    )


def _api_problem(ep: EntryPointLike) -> str | None:
    # The verdict stored with a cached entry point, so that the common path never imports
    # packaging; a live entry point (cache disabled) is checked now.
    if isinstance(ep.dist, CachedDistribution):
        return ep.dist.api_problem
    from kwplug._plugins._api_range import api_problem

    return api_problem(ep.dist)


@functools.cache
def _load_cached(ep: EntryPointLike) -> PluginRecord:
    record = _load(ep)
    if record.error is not None:
        message = (
            f"kwplug: handler plugin {record.describe()} failed to load and is skipped: "
            f"{record.error}"
        )
        _warn(message, record)
    elif record.load_seconds > SLOW_IMPORT_SECONDS:
        message = (
            f"kwplug: handler plugin {record.describe()} took {record.load_seconds:.1f} s to "
            "import; every process pays this at start-up"
        )
        _warn(message, record)
    return record


def _warn(message: str, record: PluginRecord) -> None:
    # Point the warning at the user's line (the Accelerator(), the discover() call), not at
    # kwplug's own frames, whatever depth the cached loaders are reached from.
    warning = PluginLoadWarning(message, plugin=record.name, distribution=record.distribution)
    warnings.warn(warning, stacklevel=user_stacklevel())
    logger.debug(message)


@functools.cache
def _incompatible(ep: EntryPointLike, problem: str) -> PluginRecord:
    distribution, version = _dist(ep)
    record = PluginRecord(
        ep.name, ep.value, distribution, version, error=problem, status="incompatible"
    )  # never built-in: built-ins are not checked against the API range
    message = f"kwplug: handler plugin {record.describe()} is not loaded: {problem}"
    _warn(message, record)
    return record


def _builtin(ep: EntryPointLike) -> bool:
    # A cached entry point carries the verdict derived again from its distribution's files
    # when the cache was read (kwplug._plugins._cache_trust).
    if isinstance(ep.dist, CachedDistribution):
        return ep.dist.builtin
    return ep.dist is not None and is_own_distribution(ep.dist)


def _dist(ep: EntryPointLike) -> tuple[str, str]:
    if ep.dist is None:
        return "<unknown>", "<unknown>"
    return ep.dist.name, ep.dist.version


def _order_key(record: PluginRecord) -> tuple[bool, str, str]:
    # Third-party plugins first (by distribution, then entry-point name), built-ins last.
    return (record.builtin, record.distribution.lower(), record.name)


@functools.cache
def _warn_unknown_once(controls: LoadControls, known: tuple[tuple[str, str], ...]) -> None:
    controls.warn_unknown(known)


def discover(*, refresh: bool = False, strict: bool | None = None) -> tuple[PluginRecord, ...]:
    """Return the records of the ``kwplug.handlers`` entry points, in precedence order.

    Third-party plugins come first (sorted by distribution name, then entry-point name), then
    kwplug's built-ins; the order does not depend on the order entry points are found in.
    Every entry point is listed with its ``status``; only ``"loaded"`` ones take part in
    hook calls. A failed plugin is reported once per process with a
    :class:`~kwplug.errors.PluginLoadWarning`; blocked and disabled plugins are not imported.

    Args:
        refresh: forget the per-process cache and read the entry points again (after a
            ``pip install`` in the same process); the on-disk cache is used only if nothing
            it depends on changed (see :mod:`kwplug._plugins._cache`).
        strict: raise when a plugin failed to load; ``None`` (default): as
            ``KWPLUG_STRICT_PLUGINS`` says. ``kwplug plugins`` passes ``False`` to list the
            failure instead.

    Raises:
        PluginLoadError: a plugin failed to load and ``KWPLUG_STRICT_PLUGINS=1`` (or
            ``strict=True``), or ``KWPLUG_STRICT_PLUGINS`` has a value that is not a boolean.
    """
    if refresh:
        _forget()
    controls = LoadControls.from_env()
    records = _discover(controls)
    error = strict_error(records) if (controls.strict if strict is None else strict) else None
    if error is not None:
        raise error
    return records


@functools.cache
def _discover(controls: LoadControls) -> tuple[PluginRecord, ...]:
    # Cached per set of controls: reading distribution metadata is the costly part, and the
    # environment variables may change between calls (tests, notebooks).
    records = []
    # Built-ins are imported before any third-party plugin, so that no third-party import
    # (which may replace sys.modules["kwplug"], say) can stop them loading.
    eps = sorted(_entry_points(), key=lambda ep: not _builtin(ep))
    expect_plugins(frozenset(_top(ep) for ep in eps if not _builtin(ep)))
    for ep in eps:
        if _visible is not None and not _visible(ep):
            continue
        distribution, version = _dist(ep)
        builtin = _builtin(ep)
        status = controls.status(ep.name, distribution, builtin)
        problem = None if builtin or status is not None else _api_problem(ep)
        if problem is not None:  # never imported: an incompatible plugin is not half-loaded
            records.append(_incompatible(ep, problem))
        elif status is None:
            records.append(_load_cached(ep))
        else:
            records.append(
                PluginRecord(
                    ep.name, ep.value, distribution, version, status=status, builtin=builtin
                )
            )
    if controls.allow or controls.block:
        _warn_unknown_once(controls, tuple(sorted((r.name, r.distribution) for r in records)))
    ordered = tuple(sorted(records, key=_order_key))
    warn_clashes(ordered)  # once per set of controls, as this function is cached
    return ordered


def strict_error(records: tuple[PluginRecord, ...]) -> PluginLoadError | None:
    """The error ``KWPLUG_STRICT_PLUGINS`` raises for ``records``' failed plugins, or ``None``
    when every plugin loaded (or was blocked or disabled)."""
    failed = [r for r in records if r.status in ("failed", "incompatible")]
    if not failed:
        return None
    return PluginLoadError(
        "KWPLUG_STRICT_PLUGINS is set and handler plugin(s) failed to load: "
        + "; ".join(f"{r.describe()}: {r.error}" for r in failed),
        plugins=tuple((r.name, r.distribution) for r in failed),
    )

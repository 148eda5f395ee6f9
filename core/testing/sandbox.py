"""``PluginSandbox``: discovery isolated to kwplug's built-ins and the plugins a test adds.

A plugin author's tests should not depend on which other plugins happen to be installed, nor
on the ``KWPLUG_*`` loading controls of the shell. Inside a sandbox, discovery sees kwplug's
built-ins, the distributions named in ``keep_installed``, and plugins added with
:meth:`PluginSandbox.add` -- which are real entry points: kwplug writes a ``.dist-info``
folder (``METADATA`` with ``Requires-Dist``, ``entry_points.txt``) into a temporary folder on
``sys.path``, so they go through exactly the code path of a ``pip install``-ed plugin (loading
controls, API range, validation, order).
"""

from __future__ import annotations

import os
import sys
import tempfile
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import importlib_metadata
import pluggy

from kwplug import _plugins
from kwplug._plugins import EntryPointLike, control_name
from kwplug.accelerator import Accelerator
from kwplug.handler import KwargsHandler

_CONTROL_PREFIX = "KWPLUG_"
# Not loading controls but where discovery's on-disk cache lives: kept, so that a test run can
# point it away from the user's cache folder (the cache keys on sys.path, sandboxes included).
_KEPT = frozenset({"KWPLUG_CACHE_DIR", "KWPLUG_NO_CACHE"})
_ACTIVE: list[PluginSandbox] = []  # innermost last


def active_environment() -> dict[str, str]:
    """Environment variables that give a child process the innermost active sandbox's view
    of plugins (empty when no sandbox is active); see :meth:`PluginSandbox.environment`."""
    return _ACTIVE[-1].environment() if _ACTIVE else {}


class PluginSandbox:
    """Isolated plugin discovery for the duration of a ``with`` block (or a pytest fixture).

    Args:
        keep_installed: distribution names of installed plugins to keep visible (e.g. the
            plugin under test, ``"kwplug-fsdp"``); every other third-party plugin is hidden.
        directory: where the sandbox writes its distributions (default: a temporary folder,
            removed on exit).

    On entry the ``KWPLUG_*`` environment variables are removed (set them inside the block to
    test loading controls; ``KWPLUG_CACHE_DIR`` and ``KWPLUG_NO_CACHE`` are kept) and kwplug's
    discovery caches are cleared; on exit both are restored, along with ``sys.path``.
    """

    def __init__(
        self, *, keep_installed: Iterable[str] = (), directory: str | os.PathLike[str] | None = None
    ) -> None:
        self._keep: set[str] = set()
        self._initial_keep = tuple(keep_installed)
        self._outer_visible: Callable[[EntryPointLike], bool] | None = None
        self._directory = None if directory is None else Path(directory)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._added: set[str] = set()
        self._roots: list[str] = []
        self._saved_env: dict[str, str] = {}

    # -- context ---------------------------------------------------------------------------

    def __enter__(self) -> PluginSandbox:
        if self._directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kwplug-sandbox-")
            self._directory = Path(self._tmp.name)
        self._saved_env = {k: v for k, v in os.environ.items() if _is_control(k)}
        for name in self._saved_env:
            del os.environ[name]
        self._outer_visible = _plugins.visible()  # sandboxes nest
        _plugins.set_visible(self._visible)
        _ACTIVE.append(self)
        if self._initial_keep:
            try:
                self.keep_installed(*self._initial_keep)
            except ValueError:
                self.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        for root in self._roots:
            if root in sys.path:
                sys.path.remove(root)
        for name in [k for k in os.environ if _is_control(k)]:
            del os.environ[name]
        os.environ.update(self._saved_env)
        _plugins.set_visible(self._outer_visible)
        if self._tmp is not None:
            self._tmp.cleanup()

    # -- what tests use --------------------------------------------------------------------

    def keep_installed(self, *distributions: str) -> None:
        """Make these installed distributions' plugins visible too.

        Raises:
            ValueError: a distribution declares no ``kwplug.handlers`` entry point here (not
                installed, or misspelt); the message lists the installed plugin distributions.
        """
        installed = {
            control_name(ep.dist.name)
            for ep in importlib_metadata.entry_points(group=_plugins.GROUP)
            if ep.dist is not None
        }
        missing = sorted({control_name(name) for name in distributions} - installed)
        if missing:
            raise ValueError(
                f"keep_installed: no kwplug plugin distribution named {', '.join(missing)} is "
                f"installed; installed: {', '.join(sorted(installed - {'kwplug'})) or 'none'}"
            )
        self._keep.update(control_name(name) for name in distributions)
        _plugins.discover(refresh=True)

    def add(
        self,
        plugin: Any,
        *,
        name: str | None = None,
        distribution: str = "kwplug-sandbox-plugin",
        version: str = "0.0.0",
        requires: Iterable[str] = (),
    ) -> _plugins.PluginRecord:
        """Install ``plugin`` as the entry point ``name`` of a sandbox distribution.

        Args:
            plugin: a module-level :class:`~kwplug.KwargsHandler` subclass, any module-level
                object with ``@kwplug.hookimpl`` methods, a module, or an entry-point value
                string ``"module:attribute"`` (imported only when discovery loads it).
            name: the entry-point name (default: the class or module name, lower-cased).
            distribution: the distribution declaring it (several ``add`` calls may share one).
            version: that distribution's version.
            requires: its ``Requires-Dist`` lines, e.g. ``["kwplug>=0.1,<0.2"]`` (the API
                range it declares).

        Returns:
            The plugin's :class:`~kwplug._plugins.PluginRecord` as discovery now sees it.

        Raises:
            ValueError: ``plugin`` cannot be named by an import path (defined inside a
                function, or in ``__main__``), or ``name`` is taken in ``distribution``.
        """
        value = _import_path(plugin)
        name = name or value.rpartition(":")[2].rpartition(".")[2].lower() or value
        key = f"{control_name(distribution)}:{name}"
        if key in self._added:
            raise ValueError(f"entry point {name!r} already added for {distribution!r}")
        self._added.add(key)
        assert self._directory is not None, "use PluginSandbox in a with block"
        # A fresh sys.path root per distribution: importlib's path caches stay valid.
        root = self._directory / f"{len(self._roots)}"
        info = root / f"{distribution.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        metadata = [f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}"]
        metadata += [f"Requires-Dist: {line}" for line in requires]
        (info / "METADATA").write_text("\n".join(metadata) + "\n")
        (info / "entry_points.txt").write_text(f"[{_plugins.GROUP}]\n{name} = {value}\n")
        sys.path.insert(0, str(root))
        self._roots.append(str(root))
        for record in self.records(refresh=True):
            if record.name == name and control_name(record.distribution) == control_name(
                distribution
            ):
                return record
        raise AssertionError(f"entry point {name!r} of {distribution!r} was not discovered")

    def environment(self) -> dict[str, str]:
        """Environment variables under which a child process sees the plugins this sandbox
        shows: the sandbox's folders on ``PYTHONPATH`` and, unless the test set its own,
        ``KWPLUG_PLUGINS`` allowing exactly the kept and added distributions' entry points.
        :func:`kwplug.testing.run_distributed` applies it to its processes."""
        env: dict[str, str] = {}
        path = [*reversed(self._roots), os.environ.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        if "KWPLUG_PLUGINS" not in os.environ:
            env["KWPLUG_PLUGINS"] = ",".join(sorted(self._keep | self._added))
        return env

    def records(self, *, refresh: bool = False) -> tuple[_plugins.PluginRecord, ...]:
        """What :func:`kwplug.discover` sees in the sandbox, in precedence order."""
        return _plugins.discover(refresh=refresh)

    def plugin_manager(self, *handlers: KwargsHandler) -> pluggy.PluginManager:
        """A plugin manager built as an Accelerator builds it: ``handlers`` (as
        ``kwargs_handlers``), then the sandbox's default plugins."""
        checked = _plugins.require_handler_list(list(handlers))
        return _plugins.KwplugPluginManager.for_handlers(checked, self.records())

    def accelerator(self, *handlers: KwargsHandler, **kwargs: Any) -> Accelerator:
        """``kwplug.Accelerator(kwargs_handlers=handlers, **kwargs)`` in the sandbox."""
        return Accelerator(kwargs_handlers=list(handlers), **kwargs)

    def _visible(self, ep: EntryPointLike) -> bool:
        dist_name = control_name(ep.dist.name) if ep.dist is not None else ""
        return (
            dist_name == "kwplug"
            or dist_name in self._keep
            or f"{dist_name}:{ep.name}" in self._added
        )


def _is_control(name: str) -> bool:
    return name.startswith(_CONTROL_PREFIX) and name not in _KEPT


def _import_path(plugin: Any) -> str:
    if isinstance(plugin, str):
        return plugin
    if isinstance(plugin, types.ModuleType):
        return plugin.__name__
    module = getattr(plugin, "__module__", None)
    qualname = getattr(plugin, "__qualname__", None)
    if not isinstance(plugin, type) and qualname is None:
        raise ValueError(
            f"{plugin!r} has no import path; add a module-level class or module, not an instance"
        )
    if not module or module == "__main__" or not qualname or "<" in qualname:
        raise ValueError(
            f"{qualname or plugin!r} cannot be named by an entry point (module {module!r}); "
            "define it at the top level of an importable module"
        )
    return f"{module}:{qualname}"

"""A third-party plugin's import cannot change kwplug: what it replaced is put back, and named.

Discovery imports kwplug's built-ins first, then each third-party plugin inside
:func:`kwplug_kept`. That snapshot holds every ``kwplug`` / ``kwplug.*`` entry of
``sys.modules`` and the top-level bindings of each of those modules; after the import it finds

- a ``sys.modules`` entry replaced or removed (``sys.modules["kwplug"] = fake``), or a new
  ``kwplug.*`` entry that is not a module from kwplug's own folders;
- a binding of a kwplug module replaced or deleted (``kwplug.plugins.autocast.AutocastKwargs =
  None``, ``kwplug.Accelerator = Fake``), or an attribute of a class kwplug defines replaced,
  deleted or added (``AutocastKwargs.autocast = ...``), as a monkeypatch at import does;

restores each, and reports them, so that discovery marks the plugin failed with what it changed.
What training relies on outside kwplug (torch's autocast, backward, DDP, collectives and
optimizer step, ``nn.Module``'s call and state, ``DataLoader.__iter__``, safetensors, the
process's streams and signal handlers, plugins loaded before) is kept the same way, by
:class:`~kwplug._plugins._watched.Outside`.
A module must be in ``sys.modules`` for the snapshot to hold it, so before the first
third-party import :func:`preload` imports every module of the core (but ``kwplug.testing``):
one that a plugin imported itself and patched (``kwplug.utils.random.set_seed``, while nothing
had imported ``kwplug.utils.random`` yet) would otherwise be taken as found. The sharded
checkpoint storage is the exception (importing it costs ~0.8 s of torch): a copy of it that a
plugin's import brought in is dropped after that import instead, so kwplug imports it afresh.
Python cannot stop code from doing anything; this stops an import from doing it silently, and
keeps kwplug, the built-ins already loaded and every later plugin working.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
import sys
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

from kwplug._plugins._watched import Outside

_ROOT = "kwplug"
_MISSING: Any = object()
# Bindings Python itself changes while other code runs (warnings' per-module registry).
_VOLATILE = frozenset({"__warningregistry__"})


# Not preloaded: the test kit (it imports pytest) and the command-line entry module.
_NOT_PRELOADED = (f"{_ROOT}.testing", f"{_ROOT}.__main__")
# Not preloaded either, for their cost: the sharded checkpoint storage imports
# torch.distributed.checkpoint (~0.8 s, more than everything else together). kwplug imports
# it only inside the functions that use it, by its name, so a copy a plugin's import brought
# in (and may have changed) is dropped after that import: kwplug's next import runs its source.
_DEFERRED = (f"{_ROOT}.checkpoint._dcp_storage",)
_preloaded = False


def preload() -> None:
    """Import every module of the core (``kwplug.*`` but ``kwplug.testing`` and the sharded
    checkpoint storage), once per process, so that :func:`kwplug_kept` sees all of them (about
    70 ms, paid only where a third-party plugin is imported). The built-in plugins
    (``kwplug.plugins``, another folder) are not: those that load were imported before, and
    a blocked one is never imported. A module that cannot be imported here (an optional
    dependency missing, e.g. ``torchdata``) is skipped: a plugin cannot import it either."""
    global _preloaded
    if _preloaded:
        return
    _preloaded = True
    folders = [(_ROOT, sys.modules[_ROOT].__path__)]
    while folders:
        package, path = folders.pop()
        for info in pkgutil.iter_modules(path, f"{package}."):
            if info.name.startswith(_NOT_PRELOADED) or info.name in _DEFERRED:
                continue
            try:
                module = importlib.import_module(info.name)
            except Exception:  # not importable (a missing optional dependency): nothing to patch
                continue
            if info.ispkg:
                folders.append((info.name, module.__path__))


def _ours(name: str) -> bool:
    return name.startswith(_ROOT) and (len(name) == len(_ROOT) or name[len(_ROOT)] == ".")


def _folders(modules: dict[str, ModuleType]) -> tuple[str, ...]:
    # kwplug's own package folders (core/ is kwplug, plugins/ is kwplug.plugins).
    found = []
    for name in (_ROOT, f"{_ROOT}.plugins"):
        for folder in getattr(modules.get(name), "__path__", None) or ():
            found.append(os.path.realpath(folder) + os.sep)
    return tuple(found)


def _from_folders(module: Any, folders: tuple[str, ...]) -> bool:
    origin = getattr(module, "__file__", None)
    return isinstance(origin, str) and os.path.realpath(origin).startswith(folders)


@contextlib.contextmanager
def kwplug_kept(loading: str | None = None) -> Iterator[list[str]]:
    """Run the body (a plugin's import), then restore what it changed of kwplug.

    Args:
        loading: the top-level module of the plugin being imported (its own module is not
            "another plugin's").

    Yields:
        A list that, after the body, holds one line per change found and undone (empty: the
        body changed nothing of kwplug).
    """
    modules = {n: m for n, m in list(sys.modules.items()) if _ours(n)}
    bindings = {n: dict(vars(m)) for n, m in modules.items() if isinstance(m, ModuleType)}
    classes = {
        f"{name}.{cls.__qualname__}": (cls, dict(vars(cls)))
        for name, namespace in bindings.items()
        for cls in namespace.values()
        if isinstance(cls, type) and cls.__module__ == name
    }
    folders = _folders(modules)
    outside = Outside(loading)  # torch, safetensors, streams, signals, earlier plugins
    changes: list[str] = []
    try:
        yield changes
    finally:
        changes.extend(_restore(modules, bindings, folders))
        changes.extend(_restore_classes(classes))
        changes.extend(outside.restore())


def _restore_classes(classes: dict[str, tuple[type, dict[str, Any]]]) -> list[str]:
    # A method replaced, deleted or added on a kwplug class (a new hookimpl on a built-in
    # handler would change every Accelerator); dunder names Python adds (__slotnames__) pass.
    changes = []
    for qualname, (cls, before) in classes.items():
        for attr, value in before.items():
            now = cls.__dict__.get(attr, _MISSING)
            if now is not value and attr not in _VOLATILE:
                changes.append(f"{'deleted' if now is _MISSING else 'replaced'} {qualname}.{attr}")
                type.__setattr__(cls, attr, value)
        for attr in [a for a in cls.__dict__ if a not in before and not a.startswith("__")]:
            changes.append(f"added {qualname}.{attr}")
            type.__delattr__(cls, attr)
    return changes


def _restore(
    modules: dict[str, ModuleType], bindings: dict[str, dict[str, Any]], folders: tuple[str, ...]
) -> list[str]:
    changes = []
    for name, module in modules.items():
        now = sys.modules.get(name, _MISSING)
        if now is not module:
            what = "removed" if now is _MISSING else "replaced"
            changes.append(f"{what} sys.modules[{name!r}]")
            sys.modules[name] = module
    for name in [n for n in list(sys.modules) if _ours(n) and n not in modules]:
        if not _from_folders(sys.modules[name], folders):  # kwplug.testing imported: fine
            changes.append(f"added sys.modules[{name!r}] (not a module of kwplug's)")
            del sys.modules[name]
        elif name in _DEFERRED:  # not in the snapshot: compared with a fresh copy, forgotten
            changes.extend(_forget(name))
    for name, before in bindings.items():
        namespace = vars(modules[name])
        for attr, value in before.items():
            if attr in _VOLATILE:
                continue
            now = namespace.get(attr, _MISSING)
            if now is not value:
                what = "deleted" if now is _MISSING else "replaced"
                changes.append(f"{what} {name}.{attr}")
                namespace[attr] = value
    return changes


def _forget(name: str) -> list[str]:
    # Drop a module a plugin's import brought in from sys.modules and from its package's
    # namespace (``from package import module`` reads the attribute first), so that kwplug's
    # next import executes its source; name what differs from a fresh execution of it (cheap
    # here: what it imports is loaded already).
    module = sys.modules.pop(name)
    package, _, leaf = name.rpartition(".")
    parent = sys.modules.get(package)
    if parent is not None and vars(parent).get(leaf) is module:
        delattr(parent, leaf)
    try:
        fresh = importlib.import_module(name)
    except Exception:  # the plugin's copy imported; a fresh one that does not: nothing to name
        return []
    finally:
        sys.modules.pop(name, None)
        if parent is not None and leaf in vars(parent):
            delattr(parent, leaf)
    changes = [f"replaced {name}.{attr}" for attr in _differ(vars(fresh), vars(module))]
    for attr, cls in vars(fresh).items():
        was = vars(module).get(attr)
        if isinstance(cls, type) and isinstance(was, type) and cls.__module__ == name:
            changes += [f"replaced {name}.{attr}.{a}" for a in _differ(vars(cls), vars(was))]
    return changes


def _differ(genuine: Mapping[str, Any], seen: Mapping[str, Any]) -> list[str]:
    # Names whose value is not what the source defines: another type, or a function or class
    # of another name or module (each execution makes new objects, so identity cannot tell).
    def key(value: Any) -> tuple[Any, ...]:
        if callable(value):
            return (
                type(value),
                getattr(value, "__module__", None),
                getattr(value, "__qualname__", None),
            )
        return (type(value),)

    return [
        attr
        for attr, value in genuine.items()
        if not attr.startswith("__") and key(seen.get(attr, _MISSING)) != key(value)
    ]

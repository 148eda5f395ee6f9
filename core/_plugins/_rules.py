"""What makes a valid plugin: every rule, used by discovery, by the manager and by
``kwplug.testing.check_handler`` alike.

- An entry point names a :class:`~kwplug.KwargsHandler` subclass decorated with
  ``@attrs.define``, or a plugin object that is not a class (e.g. a module).
- ``device_types``, when declared, is a non-empty collection of device type strings.
- Hook implementations pass pluggy's validation against :class:`~kwplug.hookspecs.HandlerSpec`
  (names and argument names), none declares an argument with a default (pluggy would never
  pass it), and none is marked ``tryfirst`` (kwplug decides the order).
- ``kwargs_handlers`` is a sequence of handler *instances*, at most one per class.

Each ``*_problem`` function returns why the rule is broken, as a sentence, or ``None``; the
``require_*`` functions raise ``TypeError``/``ValueError`` instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import pluggy
from pluggy import HookImpl

from kwplug.handler import KwargsHandler
from kwplug.hookspecs import PROJECT_NAME, HandlerSpec


def entry_point_object_problem(obj: Any, value: str) -> str | None:
    """Why the object entry point ``value`` names cannot be a plugin, or ``None``.

    Args:
        obj: the loaded entry-point target.
        value: the entry point's ``module:attr``, to name it.
    """
    if not isinstance(obj, type):
        return None
    if not issubclass(obj, KwargsHandler):
        return (
            f"{value} is a class but not a kwplug.KwargsHandler subclass; an entry point "
            "must name a KwargsHandler subclass or a plugin object (e.g. a module)"
        )
    if not obj.is_attrs_class():
        return f"{value} is not an attrs class (decorate it with @attrs.define)"
    return None


def device_types_problem(plugin: Any) -> str | None:
    """Why ``plugin``'s ``device_types`` declaration is malformed, or ``None`` when it is fine
    (absent, ``None``, or a non-empty collection of non-empty ``str``)."""
    declared = getattr(plugin, "device_types", None)
    if declared is None:
        return None
    if (
        isinstance(declared, (str, bytes))
        or not isinstance(declared, Collection)
        or not declared
        or not all(isinstance(d, str) and d for d in declared)
    ):
        return (
            f"device_types must be None or a non-empty collection of device type strings "
            f"such as frozenset({{'cuda'}}), got {declared!r}"
        )
    return None


def validate_hookimpls(pm: pluggy.PluginManager, plugin: Any, name: str) -> None:
    """Register ``plugin`` under ``name`` and check its hook implementations against the specs.

    Raises:
        pluggy.PluginValidationError: an implementation names an unknown hook (a misspelt
            name would otherwise be ignored silently), an argument the spec lacks, or an
            argument with a default value (see :func:`defaulted_argument_problem`); the
            plugin is unregistered again.
    """
    pm.register(plugin, name=name)
    try:
        pm.check_pending()
        problem = defaulted_argument_problem(pm, plugin)
        if problem is not None:
            raise pluggy.PluginValidationError(plugin, problem)
    except pluggy.PluginValidationError:
        pm.unregister(plugin)  # a refused plugin must not stay half-registered
        raise


def _own_impls(pm: pluggy.PluginManager, plugin: Any) -> Iterator[tuple[str, HookImpl]]:
    # (hook name, implementation) for every hook implementation registered ``plugin`` has.
    for caller in pm.get_hookcallers(plugin) or ():
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin:
                yield caller.name, impl


def defaulted_argument_problem(pm: pluggy.PluginManager, plugin: Any) -> str | None:
    """Why registered ``plugin`` may not be loaded as is: a hook implementation declares an
    argument with a default value, or ``None``.

    pluggy passes a hook implementation only its arguments *without* defaults, so such an
    argument would silently keep its default (``mixed_precision="no"`` would make a bf16 run
    compute in fp32); kwplug refuses the implementation instead.
    """
    found = sorted(
        f"{impl.function.__name__}({argument}=...)"
        for _, impl in _own_impls(pm, plugin)
        for argument in impl.kwargnames
    )
    if not found:
        return None
    return (
        f"hook implementation argument(s) with a default value: {', '.join(found)}; pluggy "
        "never passes an argument that has a default, so it would always keep its default. "
        "Remove the default (the hook passes every argument the spec declares)"
    )


def tryfirst_problem(pm: pluggy.PluginManager, plugin: Any) -> str | None:
    """Why registered ``plugin`` may not be loaded as is: a hook implementation marked
    ``tryfirst`` would answer before the handlers the user passes (kwplug decides the order),
    or ``None``."""
    names = sorted(name for name, impl in _own_impls(pm, plugin) if impl.tryfirst)
    if not names:
        return None
    return (
        f"hook implementation(s) {', '.join(names)} marked tryfirst would answer before the "
        "user's kwargs_handlers; remove tryfirst (kwplug orders plugins: user handlers, "
        "third-party defaults, built-ins)"
    )


def registered_plugin_problem(pm: pluggy.PluginManager, plugin: Any) -> str | None:
    """The first rule registered ``plugin`` breaks beyond pluggy's own validation
    (``device_types``, then ``tryfirst``), or ``None``."""
    return device_types_problem(plugin) or tryfirst_problem(pm, plugin)


def spec_signatures(plugin: Any) -> str:
    """What each spec that ``plugin``'s class implements accepts, e.g.
    ``"; the specs take: autocast(device_type, mixed_precision)"`` (empty when none), so that
    a signature mismatch names the fix."""
    specs = vars(HandlerSpec)
    parts = []
    for name in dir(type(plugin)):
        function = getattr(type(plugin), name, None)
        opts = getattr(function, f"{PROJECT_NAME}_impl", None)
        spec_name = (opts or {}).get("specname") or name
        if opts is not None and spec_name in specs:
            argnames = [a for a in inspect.signature(specs[spec_name]).parameters if a != "self"]
            parts.append(f"{spec_name}({', '.join(argnames)})")
    return f"; the specs take: {', '.join(parts)}" if parts else ""


def require_handler_instance(handler: Any, what: str) -> KwargsHandler:
    """Check that ``handler`` is a handler instance; ``what`` names it in the error.

    Raises:
        TypeError: a class instead of an instance, not a :class:`~kwplug.KwargsHandler`, or
            a subclass not decorated with ``@attrs.define``.
    """
    if isinstance(handler, type):
        raise TypeError(
            f"{what} is the class {handler.__qualname__}; pass an instance, "
            f"e.g. {handler.__qualname__}()"
        )
    if not isinstance(handler, KwargsHandler):
        raise TypeError(
            f"{what} must be a kwplug.KwargsHandler instance (an attrs class such as "
            "AutocastKwargs, DistributedDataParallelKwargs, GradScalerKwargs, "
            f"InitProcessGroupKwargs, ProfileKwargs), got {type(handler).__qualname__}"
        )
    if not type(handler).is_attrs_class():
        raise TypeError(
            f"{what} is a {type(handler).__qualname__}, which subclasses KwargsHandler but is "
            "not decorated with @attrs.define"
        )
    return handler


# Classes whose instances passed require_handler_instance: every check it makes depends on the
# class alone (an instance's class is never a class itself), so the next instance skips them.
_HANDLER_CLASSES: set[type] = set()


def require_handler_list(kwargs_handlers: Sequence[Any] | None) -> list[KwargsHandler]:
    """Validate the user's ``kwargs_handlers`` sequence (a list or tuple).

    Raises:
        TypeError: ``kwargs_handlers`` is not a sequence (or is a string), or an item is not a
            handler instance (see :func:`require_handler_instance`).
        ValueError: two handlers of the same class.
    """
    if kwargs_handlers is None:
        return []
    if isinstance(kwargs_handlers, (str, bytes)) or not isinstance(kwargs_handlers, Sequence):
        raise TypeError(
            "kwargs_handlers must be a list of kwplug.KwargsHandler instances, "
            f"got {type(kwargs_handlers).__name__}"
        )
    handlers: list[KwargsHandler] = []
    seen: dict[type, int] = {}
    for index, handler in enumerate(kwargs_handlers):
        cls = type(handler)
        if cls not in _HANDLER_CLASSES:  # what require_handler_instance checks is the class's
            require_handler_instance(handler, f"kwargs_handlers[{index}]")
            if len(_HANDLER_CLASSES) >= 256:
                _HANDLER_CLASSES.clear()
            _HANDLER_CLASSES.add(cls)
        if cls in seen:
            raise ValueError(
                f"kwargs_handlers[{seen[cls]}] and kwargs_handlers[{index}] are both "
                f"{cls.__qualname__}; pass at most one handler of each class"
            )
        seen[cls] = index
        handlers.append(handler)
    return handlers

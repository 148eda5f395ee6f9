"""Per-Accelerator plugin registration: who answers each hook, and in which order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pluggy

from kwplug.discovery import PluginRecord, loaded, new_plugin_manager, plugin_object
from kwplug.handler import KwargsHandler


def check_handler(handler: Any, what: str) -> KwargsHandler:
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


def check_handlers(kwargs_handlers: Sequence[Any] | None) -> list[KwargsHandler]:
    """Validate the user's ``kwargs_handlers`` sequence (a list or tuple).

    Raises:
        TypeError: ``kwargs_handlers`` is not a sequence (or is a string), or an item is not a
            handler instance (see :func:`check_handler`).
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
        check_handler(handler, f"kwargs_handlers[{index}]")
        cls = type(handler)
        if cls in seen:
            raise ValueError(
                f"kwargs_handlers[{seen[cls]}] and kwargs_handlers[{index}] are both "
                f"{cls.__qualname__}; pass at most one handler of each class"
            )
        seen[cls] = index
        handlers.append(handler)
    return handlers


def user_plugin_name(index: int, handler: KwargsHandler) -> str:
    """The name a user-passed handler is registered under."""
    cls = type(handler)
    return f"user[{index}]:{cls.__module__}.{cls.__qualname__}"


def default_plugin_name(record: PluginRecord) -> str:
    """The name a default plugin is registered under: ``distribution:entry-point``."""
    return f"{record.distribution}:{record.name}"


def build_plugin_manager(
    handlers: Sequence[KwargsHandler], records: Sequence[PluginRecord]
) -> tuple[pluggy.PluginManager, dict[str, str], frozenset[str]]:
    """Register user handlers and default plugins in precedence order.

    pluggy calls the most recently registered implementation first, so plugins are registered
    in reverse precedence: built-in defaults, then third-party defaults, then the user's
    handlers (last in the list first). A default handler class is skipped when the user passed
    an instance of it or of a subclass (the subclass replaces it), or when its
    ``register_default`` is false. Each Accelerator has its own manager and registers objects
    under explicit names, so equal (by value) handlers in two Accelerators never collide.

    Returns:
        The manager, a mapping of registered name to a human description for messages, and
        the registered names of third-party default plugins.

    Raises:
        TypeError: a user handler's hookimpls fail pluggy's validation (names the class).
    """
    pm = new_plugin_manager()
    descriptions: dict[str, str] = {}
    defaults: list[tuple[str, Any]] = []
    third_party: set[str] = set()
    seen: set[type] = set()
    for record in loaded(records):
        cls = record.handler_class
        if cls is not None and (
            not cls.register_default
            or cls in seen  # two entry points naming one class: the first in order wins
            or any(isinstance(h, cls) for h in handlers)
        ):
            continue
        if cls is not None:
            seen.add(cls)
        name = default_plugin_name(record)
        descriptions[name] = f"default plugin {record.describe()}"
        if not record.builtin:
            third_party.add(name)
        defaults.append((name, plugin_object(record)))
    for name, obj in reversed(defaults):
        pm.register(obj, name=name)
    for index in reversed(range(len(handlers))):
        handler = handlers[index]
        name = user_plugin_name(index, handler)
        descriptions[name] = f"kwargs_handlers[{index}] ({type(handler).__qualname__})"
        try:
            pm.register(handler, name=name)
            pm.check_pending()  # a misspelt hook name would otherwise be ignored silently
        except pluggy.PluginValidationError as exc:
            raise TypeError(
                f"kwargs_handlers[{index}] ({type(handler).__qualname__}) has an invalid "
                f"hook implementation: {exc}"
            ) from exc
    return pm, descriptions, frozenset(third_party)


def extra_impls(pm: pluggy.PluginManager, plugin: object, hook_name: str) -> list[Any]:
    """Bound methods of ``plugin`` marked ``@kwplug.hookimpl`` for ``hook_name``.

    Used with ``HookCaller.call_extra`` so that a per-call handler (``autocast(handler)``)
    answers first without being registered.
    """
    methods = []
    for attr in dir(plugin):
        opts = pm.parse_hookimpl_opts(plugin, attr)
        if opts is not None and (opts.get("specname") or attr) == hook_name:
            methods.append(getattr(plugin, attr))
    return methods

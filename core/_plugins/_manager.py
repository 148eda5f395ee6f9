"""The plugin manager: one object that knows who is registered, in which order, and who answered.

:class:`KwplugPluginManager` is a ``pluggy.PluginManager`` for project ``kwplug`` with the hook
specs added. On top of pluggy it owns, per registered name, a human description (for messages)
and whether the plugin is a third-party default, and it calls hooks with provenance
(:meth:`~KwplugPluginManager.call_first`, :meth:`~KwplugPluginManager.call_each`,
:meth:`~KwplugPluginManager.call_with`) through pluggy's own ``_hookexec``, so that
``enable_tracing()`` and ``add_hookcall_monitoring()`` see every call. With
``KWPLUG_TRACE_PLUGINS=1`` every hook call, who answered and with what is logged (level
``INFO``) on the ``kwplug.trace`` logger.
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import attrs
import pluggy

from kwplug._plugins._calls import (
    PER_CALL,
    Answer,
    Recording,
    call_recorded,
    has_wrappers,
    per_call_impl,
    record,
)
from kwplug._plugins._conflicts import conflict_error, find_conflicts
from kwplug._plugins._records import PluginRecord, loaded, plugin_object
from kwplug._plugins._rules import require_handler_instance, validate_hookimpls
from kwplug.handler import KwargsHandler
from kwplug.hookspecs import PROJECT_NAME, HandlerSpec

#: Set to ``1`` to log every hook call, who answered and with what, on :data:`trace_logger`.
TRACE_ENV = "KWPLUG_TRACE_PLUGINS"
trace_logger = logging.getLogger("kwplug.trace")
logger = logging.getLogger(__name__)

_NO_OPTS: Any = object()


def revalidate(handler: Any) -> None:
    """Run ``handler``'s field validators again, if it is a :class:`~kwplug.KwargsHandler`.

    attrs validates at construction and on assignment, not when a mutable value is changed in
    place (``h.schedule_option["active"] = -5``); every hook call checks again, so that such a
    value never reaches torch.

    Raises:
        TypeError, ValueError: a field no longer passes its validator; the message names the
            handler class and says it was changed after construction.
    """
    if not isinstance(handler, KwargsHandler) or not attrs.has(type(handler)):
        return
    try:
        attrs.validate(handler)
    except (TypeError, ValueError) as exc:
        raise type(exc)(
            f"{type(handler).__qualname__} was changed after construction and is no longer "
            f"valid: {exc}"
        ) from exc


class KwplugPluginManager(pluggy.PluginManager):
    """``pluggy.PluginManager`` of project ``kwplug``: registered names, their descriptions
    and third-party status, and hook calls that report who answered.

    Each :class:`~kwplug.Accelerator` builds one with :meth:`for_handlers`. pluggy calls the
    most recently registered implementation first, so plugins are registered in reverse
    precedence.

    Attributes:
        plan: which plugin answered each ``firstresult`` hook called through :meth:`call_first`
            (hook name -> :class:`Answer`); per-call handlers do not replace these answers.
    """

    # pluggy inspects every attribute of a plugin at each ``register``
    # (``inspect.getattr_static`` over the ~50 attributes of an attrs class); an Accelerator
    # registers a handler of each class, so the answer is cached per class. Attributes set on
    # an instance (not the class) are not cached.
    _opts_cache: dict[tuple[Any, str], Any] = {}  # noqa: RUF012 - shared on purpose

    def __init__(self, *, specs: bool = True) -> None:
        """An empty manager of project ``kwplug``.

        Args:
            specs: add the hook specs (default). ``False``: the caller copies them from a
                template (:mod:`kwplug._plugins._reuse`).
        """
        super().__init__(PROJECT_NAME)
        if specs:
            self.add_hookspecs(HandlerSpec)
        self._descriptions: dict[str, str] = {}
        self._third_party: set[str] = set()
        self._recordings: list[Recording] = []
        self.plan: dict[str, Answer] = {}
        if os.environ.get(TRACE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
            self.add_hookcall_monitoring(self._trace_before, self._trace_after)

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

    # -- registration ------------------------------------------------------------------------

    @classmethod
    def for_handlers(
        cls, handlers: Sequence[KwargsHandler], records: Sequence[PluginRecord]
    ) -> KwplugPluginManager:
        """A manager with the user's ``handlers`` and the default plugins of ``records``.

        Order of answers: built-in defaults are registered first, then third-party defaults,
        then the user's handlers (last in the list first), so pluggy asks the user's handlers
        first. A default handler class is skipped when the user passed an instance of it or of
        a subclass (the subclass replaces it), or when its ``register_default`` is false. Each
        Accelerator has its own manager and registers objects under explicit names, so equal
        (by value) handlers in two Accelerators never collide.

        Args:
            handlers: the user's handler instances (already checked, see
                :func:`~kwplug._plugins._rules.require_handler_list`).
            records: discovered plugins, in precedence order (see :func:`kwplug.discover`).

        Raises:
            TypeError: a user handler's hookimpls fail pluggy's validation (names the class).
        """
        pm = cls()
        defaults: list[tuple[str, str, Any, bool]] = []
        seen: set[type] = set()
        for r in loaded(records):
            handler_class = r.handler_class
            if handler_class is not None and (
                not handler_class.register_default
                or handler_class in seen  # two entry points naming one class: first one wins
                or any(isinstance(h, handler_class) for h in handlers)
            ):
                continue
            if handler_class is not None:
                seen.add(handler_class)
            name = f"{r.distribution}:{r.name}"
            defaults.append((name, f"default plugin {r.describe()}", plugin_object(r), r.builtin))
        for name, description, obj, builtin in reversed(defaults):
            pm.register_plugin(obj, name, description, third_party=not builtin)
        for index in reversed(range(len(handlers))):
            pm.register_handler(index, handlers[index])
        return pm

    def register_plugin(
        self, plugin: Any, name: str, description: str, *, third_party: bool = False
    ) -> None:
        """Register a default ``plugin`` under ``name``, described as ``description``."""
        self._descriptions[name] = description
        if third_party:
            self._third_party.add(name)
        self.register(plugin, name=name)

    def register_handler(self, index: int, handler: KwargsHandler) -> str:
        """Register the user's ``kwargs_handlers[index]``; return its registered name,
        ``user[<index>]:<module>.<class>``.

        Raises:
            TypeError: its hookimpls fail pluggy's validation (names the class).
        """
        cls = type(handler)
        name = f"user[{index}]:{cls.__module__}.{cls.__qualname__}"
        self._descriptions[name] = f"kwargs_handlers[{index}] ({cls.__qualname__})"
        try:
            validate_hookimpls(self, handler, name)
        except pluggy.PluginValidationError as exc:
            raise TypeError(
                f"kwargs_handlers[{index}] ({cls.__qualname__}) has an invalid "
                f"hook implementation: {exc}"
            ) from exc
        return name

    def describe(self, name: str) -> str:
        """How messages name the plugin registered as ``name`` (``name`` itself if unknown)."""
        return self._descriptions.get(name, name)

    def descriptions(self) -> list[str]:
        """The descriptions of every plugin registered through this manager."""
        return list(self._descriptions.values())

    def is_third_party(self, name: str) -> bool:
        """Whether ``name`` is a third-party plugin registered by default."""
        return name in self._third_party

    def hook_impls(self, hook: str) -> list[pluggy.HookImpl]:
        """The implementations of ``hook`` in pluggy's storage order (the last answers first)."""
        return list(getattr(self.hook, hook).get_hookimpls())

    # -- hook calls --------------------------------------------------------------------------

    def call_first(self, hook: str, /, **kwargs: Any) -> Answer:
        """Call ``firstresult`` hook ``hook`` with ``kwargs``; record and return who answered.

        Raises:
            kwplug.errors.PluginHookError: a third-party implementation raised.
            Exception: whatever a built-in or user handler's implementation raised (with a
                note naming it, on Python >= 3.11).
        """
        answer = self._first(hook, (), kwargs)
        self.plan[hook] = answer
        return answer

    def call_with(self, handler: KwargsHandler | None, hook: str, /, **kwargs: Any) -> Answer:
        """Like :meth:`call_first`, with ``handler``'s implementations answering before every
        registered one, without registering it (``accelerator.autocast(handler)``). With
        ``handler=None`` this is :meth:`call_first`. A per-call answer is not recorded in
        :attr:`plan`.

        Raises:
            TypeError: ``handler`` is not a handler instance.
            kwplug.errors.PluginHookError: see :meth:`call_first`.
        """
        if handler is None:
            return self.call_first(hook, **kwargs)
        require_handler_instance(handler, f"the {hook} handler")
        revalidate(handler)
        return self._first(hook, self._methods_of(handler, hook), kwargs)

    def call_each(
        self, hook: str, /, *, only: Callable[[str], bool] | None = None, **kwargs: Any
    ) -> list[tuple[str, Any]]:
        """Call collecting (not ``firstresult``) hook ``hook``; ``(registered name, answer)``
        per plugin called, in call order (``None`` answers included).

        Args:
            hook: the hook name.
            only: which registered names to call (default: all).
            kwargs: the hook's arguments.

        Raises:
            kwplug.errors.PluginHookError: see :meth:`call_first`.
        """
        impls = [i for i in self.hook_impls(hook) if only is None or only(i.plugin_name)]
        recording = self._record(hook, impls)
        self._run(recording, kwargs, firstresult=False)
        return recording.answers

    def conflicts(self, device_type: str) -> dict[str, str]:
        """Hook name -> the third-party default plugins (described) that all claim it for
        ``device_type``, for each one-answer hook claimed twice or more (empty: none)."""
        return find_conflicts(self, device_type)

    def check_conflicts(self, device_type: str) -> None:
        """Raise if :meth:`conflicts` finds any.

        Raises:
            kwplug.errors.PluginConflictError: naming every conflicting hook and plugin, and
                how to choose.
        """
        found = self.conflicts(device_type)
        if found:
            raise conflict_error(found, device_type)

    # -- internals ---------------------------------------------------------------------------

    def _first(
        self, hook: str, extra: Sequence[Callable[..., Any]], kwargs: Mapping[str, Any]
    ) -> Answer:
        caller = getattr(self.hook, hook)
        impls = self.hook_impls(hook)
        if has_wrappers(impls):  # a wrapper may change the answer: no provenance to report
            for impl in impls:
                revalidate(impl.plugin)
            result = caller.call_extra(list(extra), dict(kwargs)) if extra else caller(**kwargs)
            return Answer(hook, result, None, ())
        # Per-call handlers answer before every registered plugin: pluggy calls the last first.
        recording = self._record(hook, [*impls, *(per_call_impl(f) for f in reversed(extra))])
        self._run(recording, kwargs, firstresult=True)
        answer = recording.answer()
        logger.debug("hook %s answered by %s", hook, self.describe(answer.plugin or "no plugin"))
        return answer

    def _record(self, hook: str, impls: Sequence[pluggy.HookImpl]) -> Recording:
        return record(hook, impls, self.describe, self.is_third_party)

    def _run(self, recording: Recording, kwargs: Mapping[str, Any], *, firstresult: bool) -> None:
        for impl in recording.impls:
            revalidate(impl.plugin)  # None for a per-call handler: call_with checked it
        self._recordings.append(recording)  # for the trace: who answered this call
        try:
            call_recorded(self, recording, kwargs, firstresult)
        finally:
            self._recordings.pop()

    def _methods_of(self, plugin: object, hook: str) -> list[Callable[..., Any]]:
        # Bound methods of ``plugin`` marked @kwplug.hookimpl for ``hook``.
        methods = []
        for attr in dir(plugin):
            opts = self.parse_hookimpl_opts(plugin, attr)
            if opts is not None and (opts.get("specname") or attr) == hook:
                methods.append(getattr(plugin, attr))
        return methods

    def _trace_before(
        self, hook: str, impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, Any]
    ) -> None:
        order = [self.describe(i.plugin_name) for i in reversed(impls)]
        trace_logger.info("hook %s(%s) asks %s", hook, ", ".join(sorted(kwargs)), order)

    def _trace_after(
        self,
        outcome: pluggy.Result[Any],
        hook: str,
        impls: Sequence[pluggy.HookImpl],
        kwargs: Mapping[str, Any],
    ) -> None:
        if outcome.exception is not None:
            trace_logger.info("hook %s raised %r", hook, outcome.exception)
            return
        recording = self._recordings[-1] if self._recordings else None
        if recording is None or not recording.handed(impls):  # a plain pm.hook.<name>() call
            trace_logger.info("hook %s returned %r", hook, outcome.get_result())
            return
        for name, answer in recording.answers:
            who = "the per-call handler" if name == PER_CALL else self.describe(name)
            trace_logger.info("hook %s answered by %s: %r", hook, who, answer)

"""The one caller of an Accelerator's hooks: record, run and answer, with provenance.

pluggy orders the implementations (user handlers, third-party, built-ins; ``tryfirst`` /
``trylast``), validates them and runs them (``_multicall``); for a ``firstresult`` hook it
returns the first non-``None`` answer but not *whose* answer it was. kwplug needs that to name
the plugin in errors and in ``Accelerator.plan``. So :class:`HookCalls` hands pluggy's
``PluginManager._hookexec`` -- the one entry point that ``enable_tracing()`` and
``add_hookcall_monitoring()`` watch -- *recording twins* of the implementations: copies whose
functions record their answer and turn a third-party plugin's exception into
:class:`~kwplug.errors.PluginHookError`. pluggy still does the calling, ordering and
``firstresult`` short cut; monitoring sees one call per hook call, with the real plugin names.

A hook asked a second time keeps its twins while its registered implementations stay the
same (``register``/``unregister`` make new ones); a hook asked once keeps nothing. What a call
records is kept per thread. When nothing watches the manager (no ``enable_tracing()``, no
``add_hookcall_monitoring()``, ``_hookexec`` not overridden) and the hook has no wrapper, the
loop of pluggy's ``_multicall`` runs here over the implementations' public attributes, without
twins (private names of pluggy used: ``tests/gates/test_pluggy_private.py`` lists them).
The typed way in: :mod:`kwplug._plugins._relays` (``plugins.first.<hook>(...)``).

Only construction, ``prepare()``, ``autocast(handler)``, ``profile()``, ``no_sync``,
``trigger_sync_in_backward`` and checkpoints call hooks; nothing here runs per training step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from threading import get_ident
from typing import Any, Protocol

import attrs
import pluggy

from kwplug._plugins._impls import arguments, copy_impl, per_call_impl
from kwplug.errors import PluginHookError
from kwplug.handler import KwargsHandler

#: The registered name a per-call handler (``accelerator.autocast(handler)``) answers under.
PER_CALL = "<per-call handler>"

logger = logging.getLogger("kwplug._plugins._manager")


@attrs.frozen
class Answer:
    """The result of a ``firstresult`` hook call and who gave it.

    Attributes:
        hook: the hook name.
        result: the first non-``None`` answer, or ``None`` when every plugin declined.
        plugin: the registered name of the plugin that answered (``None`` if none did).
        asked: registered names of the plugins asked, in call order, up to the answer.
    """

    hook: str
    result: Any
    plugin: str | None
    asked: tuple[str, ...]


def revalidate(handler: Any) -> None:
    """Run ``handler``'s field validators again, if it is a :class:`~kwplug.KwargsHandler`.

    attrs validates at construction and on assignment, not when a mutable value is changed in
    place (``h.schedule_option["active"] = -5``); every hook call checks again, so that such a
    value never reaches torch.

    Raises:
        TypeError, ValueError: a field no longer passes its validator; the message names the
            handler class and says it was changed after construction.
    """
    if isinstance(handler, KwargsHandler) and attrs.has(type(handler)):
        _revalidate(handler)


def _revalidate(handler: KwargsHandler) -> None:
    try:
        attrs.validate(handler)
    except (TypeError, ValueError) as exc:
        raise type(exc)(
            f"{type(handler).__qualname__} was changed after construction and is no longer "
            f"valid: {exc}"
        ) from exc


class Manager(Protocol):
    """What :class:`HookCalls` needs of its plugin manager."""

    @property
    def hook(self) -> pluggy.HookRelay: ...

    @property
    def plan(self) -> dict[str, Answer]: ...

    def describe(self, name: str) -> str: ...

    def is_third_party(self, name: str) -> bool: ...

    @property
    def watched(self) -> bool: ...

    def _hookexec(
        self,
        hook_name: str,
        methods: Sequence[pluggy.HookImpl],
        kwargs: Mapping[str, object],
        firstresult: bool,
    ) -> object | list[object]: ...


class _Twins:
    # A hook's registered implementations as they were (to tell when they change), whether
    # one is a wrapper, the handlers that every call re-validates and, once a watched call
    # needed them, their recording twins (wrappers as they are).
    # A plain class: attrs' frozen __init__ costs a microsecond per hook per Accelerator.
    __slots__ = ("handlers", "impls", "source", "wrapped")

    def __init__(self, source: list[pluggy.HookImpl]) -> None:
        self.source = source
        self.impls: list[pluggy.HookImpl] | None = None
        # Plain loops, no generators: every hook's first call per Accelerator builds one.
        wrapped = False
        handlers: list[KwargsHandler] = []
        for impl in source:
            if impl.wrapper or impl.hookwrapper:
                wrapped = True
            plugin = impl.plugin
            if isinstance(plugin, KwargsHandler) and attrs.has(type(plugin)):
                handlers.append(plugin)
        self.wrapped = wrapped
        self.handlers = tuple(handlers)


class HookCalls:
    """One manager's hook caller: it records (who answered what), runs (pluggy's
    ``_hookexec``) and answers (:class:`Answer`, or each plugin's answer).

    The recording twins are shared; what a call records is kept per thread, so that calls
    from two threads never mix their answers.
    """

    __slots__ = ("_pm", "_running", "_twins")

    def __init__(self, pm: Manager) -> None:
        """The caller of ``pm``'s hooks."""
        self._pm = pm
        # Hook name -> its recording twins, from its second call on (None: called once).
        self._twins: dict[str, _Twins | None] = {}
        # Thread id -> its calls in progress, innermost last: (implementations handed to
        # pluggy, answers so far). A plain dict: a threading.local per manager made the
        # garbage collector's work per discarded Accelerator several times larger.
        self._running: dict[int, list[tuple[list[pluggy.HookImpl], list[tuple[str, Any]]]]] = {}

    @property
    def running(self) -> list[tuple[list[pluggy.HookImpl], list[tuple[str, Any]]]]:
        """``(implementations handed to pluggy, answers so far)`` of this thread's calls in
        progress, innermost last (the trace logger reads who answered from it)."""
        return self._running.get(get_ident(), [])

    # -- the three kinds of call ---------------------------------------------------------

    def first(self, hook: str, kwargs: dict[str, Any]) -> Any:
        """Call ``firstresult`` hook ``hook``; record who answered in the manager's ``plan``
        and return the answer (``None``: every plugin declined).

        Raises:
            kwplug.errors.PluginHookError: a third-party implementation raised.
            Exception: whatever a built-in or user handler's implementation raised (with a
                note naming it, on Python >= 3.11).
        """
        twins = self._twins_of(hook)
        for handler in twins.handlers:
            _revalidate(handler)
        if twins.wrapped:  # a wrapper may change the answer: no provenance to report
            result = getattr(self._pm.hook, hook)(**kwargs)
            self._pm.plan[hook] = Answer(hook, result, None, ())
            return result
        answers = self._run(hook, twins, (), kwargs, True)
        answer = _answer(hook, answers)
        self._pm.plan[hook] = answer
        if logger.isEnabledFor(logging.DEBUG):
            who = self._pm.describe(answer.plugin or "no plugin")
            logger.debug("hook %s answered by %s", hook, who)
        return answer.result

    def first_with(
        self, extra: Sequence[Callable[..., Any]], hook: str, kwargs: dict[str, Any]
    ) -> Any:
        """Like :meth:`first`, with the functions ``extra`` (a per-call handler's methods)
        answering before every registered implementation, and nothing recorded in ``plan``.

        Raises:
            kwplug.errors.PluginHookError: see :meth:`first`.
        """
        twins = self._twins_of(hook)
        for handler in twins.handlers:
            _revalidate(handler)
        if twins.wrapped:
            caller = getattr(self._pm.hook, hook)
            return caller.call_extra(list(extra), kwargs) if extra else caller(**kwargs)
        # Per-call handlers answer before every registered plugin: pluggy calls the last first.
        added = [per_call_impl(f, PER_CALL) for f in reversed(extra)]
        return _answer(hook, self._run(hook, twins, added, kwargs, True)).result

    def each(
        self, hook: str, kwargs: dict[str, Any], only: Callable[[str], bool] | None = None
    ) -> list[tuple[str, Any]]:
        """Call collecting (not ``firstresult``) hook ``hook``: ``(registered name, answer)``
        per plugin called, in call order (``None`` answers included).

        Args:
            hook: the hook name.
            kwargs: the hook's arguments.
            only: which registered names to call (default: all).

        Raises:
            kwplug.errors.PluginHookError: see :meth:`first`.
        """
        twins = self._twins_of(hook)
        if only is None:
            handlers = twins.handlers
        else:
            twins = _Twins([i for i in twins.source if only(i.plugin_name)])
            handlers = twins.handlers
        for handler in handlers:
            _revalidate(handler)
        return self._run(hook, twins, (), kwargs, False)

    # -- record and run ------------------------------------------------------------------

    def _run(
        self,
        hook: str,
        twins: _Twins,
        added: Sequence[pluggy.HookImpl],
        kwargs: dict[str, Any],
        firstresult: bool,
    ) -> list[tuple[str, Any]]:
        # ``added``: plain implementations called before every registered one (per-call
        # handlers), not kept with the twins.
        if not twins.wrapped and not is_watched(self._pm):
            return self._plain(hook, [*twins.source, *added], kwargs, firstresult)
        if twins.impls is None:
            twins.impls = [
                i if i.wrapper or i.hookwrapper else self._twin(i, hook) for i in twins.source
            ]
        impls = [*twins.impls, *(self._twin(i, hook) for i in added)]
        answers: list[tuple[str, Any]] = []
        thread = get_ident()
        calls = self._running.get(thread)
        if calls is None:
            calls = self._running[thread] = []
        calls.append((impls, answers))
        try:
            self._pm._hookexec(hook, impls, kwargs, firstresult)
        finally:
            calls.pop()
            if not calls:
                del self._running[thread]
        return answers

    def _plain(
        self, hook: str, impls: list[pluggy.HookImpl], kwargs: Mapping[str, Any], firstresult: bool
    ) -> list[tuple[str, Any]]:
        # pluggy's _multicall for plain implementations (same order, arguments, firstresult
        # short cut and HookCallError), recording each answer and naming a failing plugin as
        # the twins do.
        answers: list[tuple[str, Any]] = []
        for impl in reversed(impls):
            # (No call for an implementation without arguments, such as comm_hooks'.)
            args, kw = arguments(impl, kwargs) if impl.argnames or impl.kwargnames else ((), None)
            try:
                result = impl.function(*args) if kw is None else impl.function(*args, **kw)
            except Exception as exc:
                error = self._failed(exc, impl.plugin_name, hook)
                if error is exc:
                    raise
                raise error from exc
            answers.append((impl.plugin_name, result))
            if result is not None and firstresult:
                break
        return answers

    def _failed(self, exc: Exception, name: str, hook: str) -> Exception:
        # What a plain implementation's exception becomes: a third-party plugin's is wrapped
        # in PluginHookError naming it; a built-in's or user handler's gets a note naming the
        # plugin (Python >= 3.11) and is returned as it is (the caller re-raises it).
        where = f"hook {hook!r} of {self._pm.describe(name)}"
        if self._pm.is_third_party(name):
            return PluginHookError(
                f"{where} raised {type(exc).__name__}: {exc}", plugin=name, hook=hook
            )
        if hasattr(exc, "add_note"):
            exc.add_note(f"(raised by {where})")
        return exc

    def _twins_of(self, hook: str) -> _Twins:
        # pluggy's copy of the registrations; a copied manager's relay (_reuse) tells it unmade.
        relay, peek = self._pm.hook, getattr(type(self._pm.hook), "peek_hookimpls", None)
        source = (peek and peek(relay, hook)) or getattr(relay, hook).get_hookimpls()
        twins = self._twins.get(hook)
        if twins is None or twins.source != source:  # HookImpl compares by identity
            if hook in self._twins:  # asked again: keep the twins for the next calls
                twins = self._twins[hook] = _Twins(source)
            else:  # the first call (most hooks are asked once per Accelerator): nothing kept,
                twins = _Twins(source)  # so that a discarded manager is little garbage
                self._twins[hook] = None
        return twins

    def _twin(self, impl: pluggy.HookImpl, hook: str) -> pluggy.HookImpl:
        # A copy of a plain implementation whose function records its answer in the running
        # call and names the plugin when it raises: a third-party plugin's exception becomes
        # PluginHookError, a built-in's or user handler's gets a note (Python >= 3.11).
        # ``impl.function`` is read at each call, so that a function swapped in later runs.
        name, running = impl.plugin_name, self._running

        def call(*args: Any, **kwargs: Any) -> Any:  # keywords: pluggy's ``kwargnames``
            try:
                result = impl.function(*args, **kwargs)
            except Exception as exc:
                error = self._failed(exc, name, hook)
                if error is exc:
                    raise
                raise error from exc
            running[get_ident()][-1][1].append((name, result))
            return result

        return copy_impl(impl, impl.plugin, call)


def _answer(hook: str, answers: list[tuple[str, Any]]) -> Answer:
    # A firstresult call's Answer: the last implementation called answered, unless every one
    # declined.
    asked = tuple(name for name, _ in answers)
    if answers and answers[-1][1] is not None:
        name, result = answers[-1]
        return Answer(hook, result, name, asked)
    return Answer(hook, None, None, asked)


def is_watched(pm: Any) -> bool:
    """Whether tracing or monitoring watches ``pm`` (counted by the manager), or its
    ``_hookexec`` is overridden: hook calls must then go through ``_hookexec``."""
    return (
        pm.watched
        or type(pm)._hookexec is not pluggy.PluginManager._hookexec
        or "_hookexec" in vars(pm)
    )

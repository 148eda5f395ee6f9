"""Hook calls that know which plugin answered (provenance) and whose code failed.

pluggy orders the implementations (user handlers, third-party, built-ins; ``tryfirst`` /
``trylast``), validates them and runs them (``_multicall``); for a ``firstresult`` hook it
returns the first non-``None`` answer but not *whose* answer it was. kwplug needs that to name
the plugin in errors and in ``Accelerator.plan``. So each call here hands pluggy's
``PluginManager._hookexec`` -- the one entry point that ``enable_tracing()`` and
``add_hookcall_monitoring()`` watch -- copies of the implementations whose functions record
their answer and turn a third-party plugin's exception into
:class:`~kwplug.errors.PluginHookError`. pluggy still does the calling, ordering and
``firstresult`` short cut; monitoring sees one call per hook call, with the real plugin names.
When nothing watches the manager and no implementation is a hook wrapper (every
``Accelerator()`` without tracing), the same loop as pluggy's ``_multicall`` runs here over the
implementations themselves, recording as it goes, without the copies.

Only construction, ``prepare()``, ``autocast(handler)``, ``profile()`` and checkpoints call
hooks; nothing here runs per training step.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import pluggy

from kwplug.errors import PluginHookError

#: The registered name a per-call handler (``accelerator.autocast(handler)``) answers under.
PER_CALL = "<per-call handler>"


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


@attrs.define
class Recording:
    """What one hook call did, implementation by implementation (filled in as they are called).

    Attributes:
        hook: the hook name.
        impls: the implementations to call, in pluggy's storage order (the last is called
            first).
        answers: ``(registered name, answer)`` per implementation called, in call order.
    """

    hook: str
    impls: list[pluggy.HookImpl] = attrs.field(factory=list)
    answers: list[tuple[str, Any]] = attrs.field(factory=list)
    _describe: Callable[[str], str] = attrs.field(default=str, repr=False)
    _third_party: Callable[[str], bool] = attrs.field(default=bool, repr=False)
    _twins: list[pluggy.HookImpl] | None = attrs.field(default=None, init=False, repr=False)

    @property
    def twins(self) -> list[pluggy.HookImpl]:
        """The recording copies of :attr:`impls` handed to pluggy (made on first use, then the
        same list): each plain implementation's function records its answer and names its
        plugin when it raises; hook wrappers are passed as they are."""
        if self._twins is None:
            self._twins = [
                impl
                if impl.wrapper or impl.hookwrapper  # wraps the others' answers: not an answer
                else copy_impl(impl, impl.plugin, _recorder(self, impl))
                for impl in self.impls
            ]
        return self._twins

    def handed(self, impls: Sequence[pluggy.HookImpl]) -> bool:
        """Whether ``impls`` is the list of :attr:`twins` handed to pluggy for this call."""
        return self._twins is impls

    def answer(self) -> Answer:
        """The :class:`Answer` of a ``firstresult`` call: the last implementation called
        answered, unless every one declined."""
        asked = tuple(name for name, _ in self.answers)
        if self.answers and self.answers[-1][1] is not None:
            name, result = self.answers[-1]
            return Answer(self.hook, result, name, asked)
        return Answer(self.hook, None, None, asked)

    def failed(self, impl: pluggy.HookImpl, exc: Exception) -> Exception:
        """What a plain implementation's exception ``exc`` becomes: a third-party plugin's is
        wrapped in :class:`~kwplug.errors.PluginHookError` naming it (raise it ``from exc``);
        a built-in's or user handler's gets a note naming the plugin (Python >= 3.11) and is
        returned as it is."""
        name = impl.plugin_name
        where = f"hook {self.hook!r} of {self._describe(name)}"
        if self._third_party(name):
            return PluginHookError(
                f"{where} raised {type(exc).__name__}: {exc}", plugin=name, hook=self.hook
            )
        if hasattr(exc, "add_note"):
            exc.add_note(f"(raised by {where})")
        return exc


def per_call_impl(function: Callable[..., Any]) -> pluggy.HookImpl:
    """A plain implementation for a per-call handler's bound method (not registered)."""
    return pluggy.HookImpl(None, PER_CALL, function, _PLAIN_OPTS)


def has_wrappers(impls: Sequence[pluggy.HookImpl]) -> bool:
    """Whether any implementation is a (new- or old-style) hook wrapper."""
    return any(i.wrapper or i.hookwrapper for i in impls)


def record(
    hook_name: str,
    impls: Sequence[pluggy.HookImpl],
    describe: Callable[[str], str],
    third_party: Callable[[str], bool],
) -> Recording:
    """A :class:`Recording` of a call of ``impls`` (pluggy's storage order: the last is called
    first).

    Each plain implementation (hook wrappers are not answers) appends ``(registered name,
    answer)`` to the recording when called and, when it raises, a third-party plugin's
    exception is wrapped in :class:`~kwplug.errors.PluginHookError` naming it, or a note naming
    the plugin (Python >= 3.11) is added to a built-in's or user handler's.
    """
    return Recording(hook_name, list(impls), describe=describe, third_party=third_party)


# HookImpl's attributes, copied one by one through their slot descriptors: several times faster
# than copy.copy (which goes through __reduce_ex__) or setattr by name; every Accelerator's
# manager copy re-binds each user or default handler's implementations this way.
_IMPL_SLOTS: tuple[str, ...] | None = getattr(pluggy.HookImpl, "__slots__", None)
# All slots read in one C call (a getter of two or more names returns a tuple).
_impl_values: Callable[[pluggy.HookImpl], tuple[Any, ...]] | None = None
_impl_setters: tuple[Callable[[pluggy.HookImpl, Any], None], ...] = ()
_SET_PLUGIN: Callable[[pluggy.HookImpl, Any], None] | None = None
_SET_FUNCTION: Callable[[pluggy.HookImpl, Any], None] | None = None
if _IMPL_SLOTS and len(_IMPL_SLOTS) > 1 and {"plugin", "function"} <= set(_IMPL_SLOTS):
    _impl_values = operator.attrgetter(*_IMPL_SLOTS)
    _impl_setters = tuple(vars(pluggy.HookImpl)[name].__set__ for name in _IMPL_SLOTS)
    _SET_PLUGIN = vars(pluggy.HookImpl)["plugin"].__set__
    _SET_FUNCTION = vars(pluggy.HookImpl)["function"].__set__


def copy_impl(impl: pluggy.HookImpl, plugin: Any, function: Callable[..., Any]) -> pluggy.HookImpl:
    """A copy of ``impl`` (same options and argument names) for ``plugin`` and ``function``."""
    if _impl_values is None or _SET_PLUGIN is None or _SET_FUNCTION is None:
        twin = copy.copy(impl)  # a pluggy without __slots__ on HookImpl
        # HookImpl's attributes are Final for type checkers; this copy is ours to change.
        object.__setattr__(twin, "plugin", plugin)
        object.__setattr__(twin, "function", function)
        return twin
    twin = object.__new__(pluggy.HookImpl)
    for setter, value in zip(_impl_setters, _impl_values(impl), strict=True):
        setter(twin, value)
    _SET_PLUGIN(twin, plugin)
    _SET_FUNCTION(twin, function)
    return twin


def _recorder(recording: Recording, impl: pluggy.HookImpl) -> Callable[..., Any]:
    function, name = impl.function, impl.plugin_name

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            result = function(*args, **kwargs)
        except Exception as exc:
            error = recording.failed(impl, exc)
            if error is exc:
                raise
            raise error from exc
        recording.answers.append((name, result))
        return result

    return call


_PLAIN_OPTS: pluggy.HookimplOpts = {
    "wrapper": False,
    "hookwrapper": False,
    "optionalhook": False,
    "tryfirst": False,
    "trylast": False,
    "specname": None,
}


def call_recorded(
    pm: pluggy.PluginManager, recording: Recording, kwargs: Mapping[str, Any], firstresult: bool
) -> None:
    """Run ``recording``'s implementations; the answers land in ``recording``.

    When nothing watches ``pm``'s hook calls (no ``enable_tracing()``, no
    ``add_hookcall_monitoring()``, ``_hookexec`` not overridden) and no implementation is a
    hook wrapper, they are called here, as pluggy's ``_multicall`` would call them (same
    order, arguments, ``firstresult`` short cut and :class:`pluggy.HookCallError`), without
    making recording copies. Otherwise the copies (:attr:`Recording.twins`) go through
    ``pm._hookexec``, so that monitoring and tracing see the call.
    """
    if not _watched(pm) and not any(i.wrapper or i.hookwrapper for i in recording.impls):
        _call_plain(recording, kwargs, firstresult)
        return
    pm._hookexec(recording.hook, recording.twins, dict(kwargs), firstresult)


# pluggy's own executor: a manager whose _inner_hookexec is still this one is not traced.
_MULTICALL: Any = getattr(pluggy.PluginManager(PER_CALL), "_inner_hookexec", None)


def _watched(pm: pluggy.PluginManager) -> bool:
    # Anything between _hookexec and pluggy's _multicall: tracing, monitoring, an override.
    return (
        _MULTICALL is None
        or getattr(pm, "_inner_hookexec", None) is not _MULTICALL
        or type(pm)._hookexec is not pluggy.PluginManager._hookexec
        or "_hookexec" in vars(pm)
    )


def _call_plain(recording: Recording, kwargs: Mapping[str, Any], firstresult: bool) -> None:
    # pluggy's _multicall for plain implementations only, recording each answer.
    answers = recording.answers
    for impl in reversed(recording.impls):
        try:
            args = [kwargs[name] for name in impl.argnames]
            kw = {n: kwargs[n] for n in impl.kwargnames if n in kwargs} or None
        except KeyError as e:
            raise pluggy.HookCallError(f"hook call must provide argument {e.args[0]!r}") from e
        try:
            result = impl.function(*args) if kw is None else impl.function(*args, **kw)
        except Exception as exc:
            error = recording.failed(impl, exc)
            if error is exc:
                raise
            raise error from exc
        answers.append((impl.plugin_name, result))
        if result is not None and firstresult:
            return

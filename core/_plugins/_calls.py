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
    """What one hook call did, implementation by implementation (filled in as pluggy calls).

    Attributes:
        hook: the hook name.
        impls: the implementations handed to pluggy (the recording copies).
        answers: ``(registered name, answer)`` per implementation called, in call order.
    """

    hook: str
    impls: list[pluggy.HookImpl] = attrs.field(factory=list)
    answers: list[tuple[str, Any]] = attrs.field(factory=list)

    def answer(self) -> Answer:
        """The :class:`Answer` of a ``firstresult`` call: the last implementation called
        answered, unless every one declined."""
        asked = tuple(name for name, _ in self.answers)
        if self.answers and self.answers[-1][1] is not None:
            name, result = self.answers[-1]
            return Answer(self.hook, result, name, asked)
        return Answer(self.hook, None, None, asked)


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
    """Recording copies of ``impls`` (pluggy's storage order: the last is called first).

    Each copy of a plain implementation (hook wrappers are passed as they are) has the same
    ``argnames`` and plugin, but its function appends ``(registered name, answer)`` to the
    returned :class:`Recording` and, when it raises, wraps a third-party plugin's exception in
    :class:`~kwplug.errors.PluginHookError` naming it, or adds a note naming the plugin
    (Python >= 3.11) to a built-in's or user handler's.
    """
    recording = Recording(hook_name)
    for impl in impls:
        if impl.wrapper or impl.hookwrapper:  # wraps the others' answers: not an answer itself
            recording.impls.append(impl)
            continue
        twin = copy_impl(impl, impl.plugin, _recorder(recording, impl, describe, third_party))
        recording.impls.append(twin)
    return recording


# HookImpl's attributes, copied one by one: several times faster than copy.copy, which goes
# through __reduce_ex__ (hook calls and manager copies make several per Accelerator).
_IMPL_SLOTS: tuple[str, ...] | None = getattr(pluggy.HookImpl, "__slots__", None)
# All slots read in one C call (a getter of two or more names returns a tuple).
_impl_values: Callable[[pluggy.HookImpl], tuple[Any, ...]] | None = (
    operator.attrgetter(*_IMPL_SLOTS) if _IMPL_SLOTS and len(_IMPL_SLOTS) > 1 else None
)


def copy_impl(impl: pluggy.HookImpl, plugin: Any, function: Callable[..., Any]) -> pluggy.HookImpl:
    """A copy of ``impl`` (same options and argument names) for ``plugin`` and ``function``."""
    if _IMPL_SLOTS is None or _impl_values is None:  # a pluggy without __slots__ on HookImpl
        twin = copy.copy(impl)
    else:
        twin = object.__new__(pluggy.HookImpl)
        for name, value in zip(_IMPL_SLOTS, _impl_values(impl), strict=True):
            object.__setattr__(twin, name, value)
    # HookImpl's attributes are Final for type checkers; this copy is ours to change.
    object.__setattr__(twin, "plugin", plugin)
    object.__setattr__(twin, "function", function)
    return twin


def _recorder(
    recording: Recording,
    impl: pluggy.HookImpl,
    describe: Callable[[str], str],
    third_party: Callable[[str], bool],
) -> Callable[..., Any]:
    function, name = impl.function, impl.plugin_name

    def call(*args: Any) -> Any:
        try:
            result = function(*args)
        except Exception as exc:
            where = f"hook {recording.hook!r} of {describe(name)}"
            if third_party(name):
                raise PluginHookError(
                    f"{where} raised {type(exc).__name__}: {exc}",
                    plugin=name,
                    hook=recording.hook,
                ) from exc
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised by {where})")
            raise
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
    """Run ``recording``'s implementations through ``pm._hookexec`` (so that monitoring and
    tracing see the call); the answers land in ``recording``."""
    pm._hookexec(recording.hook, recording.impls, dict(kwargs), firstresult)

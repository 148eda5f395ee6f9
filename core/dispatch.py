"""Setup-time hook calls that know which plugin answered (provenance) and who failed.

pluggy orders the implementations (user handlers, third-party, built-ins; ``tryfirst`` /
``trylast``) and validates them; for a ``firstresult`` hook it returns the first non-``None``
answer but not *whose* answer it was. kwplug needs that to name the plugin in errors and in
``Accelerator.plan``, so these calls walk ``HookCaller.get_hookimpls()`` in pluggy's call order
and pass each implementation the arguments it names, as pluggy does. Hooks with wrapper
implementations go through pluggy's own call (and report no provenance).

Only construction and ``prepare()`` call hooks; nothing here runs per training step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import pluggy


class PluginHookError(RuntimeError):
    """A third-party plugin's hook implementation raised; the message names the plugin."""


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


def call_first(
    pm: pluggy.PluginManager,
    hook_name: str,
    kwargs: Mapping[str, Any],
    *,
    extra: Sequence[Callable[..., Any]] = (),
    describe: Callable[[str], str] = str,
    third_party: Callable[[str], bool] = lambda name: False,
) -> Answer:
    """Call ``firstresult`` hook ``hook_name`` and report who answered.

    Args:
        pm: the Accelerator's plugin manager.
        hook_name: a ``firstresult`` hook of :class:`kwplug.hookspecs.HandlerSpec`.
        kwargs: the hook's arguments by name.
        extra: per-call implementations that answer before every registered one
            (``accelerator.autocast(handler)``).
        describe: turns a registered plugin name into words for error messages.
        third_party: whether a registered name is a third-party plugin; its exceptions are
            wrapped in :class:`PluginHookError` naming it (others keep their type and get a
            note naming the plugin, on Python >= 3.11).

    Raises:
        PluginHookError: a third-party implementation raised.
        Exception: whatever a built-in or user handler's implementation raised.
    """
    caller = getattr(pm.hook, hook_name)
    impls = caller.get_hookimpls()
    if any(i.wrapper or i.hookwrapper for i in impls):
        result = caller.call_extra(list(extra), dict(kwargs)) if extra else caller(**kwargs)
        return Answer(hook_name, result, None, ())
    order: list[tuple[str, Callable[..., Any], tuple[str, ...]]] = [
        ("<per-call handler>", fn, _argnames(fn)) for fn in extra
    ]
    order += [(i.plugin_name, i.function, tuple(i.argnames)) for i in reversed(impls)]
    asked: list[str] = []
    for name, function, argnames in order:
        asked.append(name)
        result = _call_one(hook_name, name, function, argnames, kwargs, describe, third_party)
        if result is not None:
            return Answer(hook_name, result, name, tuple(asked))
    return Answer(hook_name, None, None, tuple(asked))


def call_each(
    pm: pluggy.PluginManager,
    hook_name: str,
    kwargs: Mapping[str, Any],
    *,
    describe: Callable[[str], str] = str,
    third_party: Callable[[str], bool] = lambda name: False,
    only: Callable[[str], bool] = lambda name: True,
) -> list[tuple[str, Any]]:
    """Call a collecting (not ``firstresult``) hook; ``(plugin name, answer)`` per plugin.

    Plugins are called in pluggy's order, one at a time, so that an answer (and an error) can
    be attributed; ``only`` selects which registered names are called. Errors follow the
    policy of :func:`call_first`.
    """
    impls = reversed(getattr(pm.hook, hook_name).get_hookimpls())
    return [
        (
            i.plugin_name,
            _call_one(
                hook_name,
                i.plugin_name,
                i.function,
                tuple(i.argnames),
                kwargs,
                describe,
                third_party,
            ),
        )
        for i in impls
        if only(i.plugin_name)
    ]


def _call_one(
    hook_name: str,
    name: str,
    function: Callable[..., Any],
    argnames: tuple[str, ...],
    kwargs: Mapping[str, Any],
    describe: Callable[[str], str],
    third_party: Callable[[str], bool],
) -> Any:
    # One implementation, passed the arguments it names (as pluggy does). A third-party
    # plugin's error becomes PluginHookError naming it; others keep their type, plus a note.
    try:
        return function(*(kwargs[a] for a in argnames))
    except Exception as exc:
        where = f"hook {hook_name!r} of {describe(name)}"
        if third_party(name):
            raise PluginHookError(f"{where} raised {type(exc).__name__}: {exc}") from exc
        if hasattr(exc, "add_note"):
            exc.add_note(f"(raised by {where})")
        raise


_PLAIN_OPTS: pluggy.HookimplOpts = {
    "wrapper": False,
    "hookwrapper": False,
    "optionalhook": False,
    "tryfirst": False,
    "trylast": False,
    "specname": None,
}


def _argnames(function: Callable[..., Any]) -> tuple[str, ...]:
    # pluggy's HookImpl works out which arguments an implementation takes.
    return tuple(pluggy.HookImpl(None, "<per-call>", function, _PLAIN_OPTS).argnames)

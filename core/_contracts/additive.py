"""The ``ADDITIVE`` hook policy (:data:`kwplug.hookspecs.ADDITIVE`): plugins' answers, each a
mapping of name to value, merged into one; a name given twice is an error naming both
sources. ``comm_hooks`` and ``trackers`` merge through :func:`merge`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

V = TypeVar("V")


def merge(
    hook: str,
    contributions: Iterable[tuple[str, Mapping[str, V] | None]],
    *,
    entry: Callable[[str, Any, Any], tuple[V, str]],
    label: str,
    kind: str,
    remedy: str,
    start: Mapping[str, tuple[V, str]] | None = None,
) -> dict[str, V]:
    """Merge ``hook``'s answers (``None`` answers are skipped).

    Args:
        hook: the hook's name, for messages.
        contributions: ``(source, answer)`` pairs, ``source`` naming the plugin.
        entry: called as ``entry(source, name, value)`` for every entry of an answer; checks
            it (raising ``TypeError`` with its own message) and returns the value to keep
            and the source to name in a duplicate's message.
        label: what a name names, in a duplicate's message ("communication hook").
        kind: what a value is, in the message of an answer that is no mapping
            ("kwplug.CommHook").
        remedy: the advice ending a duplicate's message.
        start: entries present before any answer, as ``name -> (value, source)``.

    Raises:
        TypeError: an answer is not a mapping (or ``entry`` refuses an entry).
        ValueError: two sources give the same name; the message names both.
    """
    merged = {name: value for name, (value, _) in (start or {}).items()}
    sources = {name: source for name, (_, source) in (start or {}).items()}
    for plugin, answer in contributions:
        if answer is None:
            continue
        if not isinstance(answer, Mapping):
            raise TypeError(
                f"plugin {plugin!r}: {hook} must return a mapping of name to {kind}, "
                f"got {type(answer).__name__}"
            )
        for name, raw in answer.items():
            value, source = entry(plugin, name, raw)
            if name in merged:
                raise ValueError(
                    f"{label} {name!r} is provided twice: by {sources[name]} and by "
                    f"{source}; {remedy}"
                )
            merged[name] = value
            sources[name] = source
    return merged

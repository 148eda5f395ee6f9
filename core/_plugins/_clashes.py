"""Entry-point names declared by more than one distribution.

A third-party plugin may pick the name of a built-in (the ``kwplug-fsdp`` example once named
its entry point ``fsdp``) or of another distribution's plugin. Nothing is shadowed: every
entry point is listed and loaded on its own, and registered under its ``distribution:name``
(:meth:`kwplug._plugins.KwplugPluginManager.for_handlers`); third-party defaults answer before
built-ins as always; a bare name in a configuration file that matches several is an error
asking for ``distribution:name`` (:mod:`kwplug.config`), and the loading controls applied to a
bare name cover every entry point of that name. But the user should know: discovery warns once
per process (:func:`warn_clashes`) and ``kwplug plugins`` prints one line per clashing name
(:func:`clash_lines`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from kwplug._plugins._records import PluginRecord
from kwplug.errors import PluginLoadWarning, user_stacklevel


def name_clashes(records: Iterable[PluginRecord]) -> dict[str, tuple[PluginRecord, ...]]:
    """Each entry-point name declared by several entry points, with their records (in
    precedence order), for names where at least one of them is third-party: the built-ins
    never clash among themselves. An entry point the loading controls switched off
    (``"blocked"``, ``"disabled"``) clashes with nothing: the user already chose."""
    by_name: dict[str, list[PluginRecord]] = {}
    for record in records:
        if record.status not in ("blocked", "disabled"):
            by_name.setdefault(record.name, []).append(record)
    return {
        name: tuple(found)
        for name, found in sorted(by_name.items())
        if len(found) > 1 and not all(r.builtin for r in found)
    }


def _declarer(record: PluginRecord) -> str:
    # The source too: a foreign metadata folder named kwplug has kwplug's name and version.
    return f"{record.distribution} {record.version} ({record.source})"


def clash_lines(records: Iterable[PluginRecord]) -> list[str]:
    """One line per clashing name, as ``kwplug plugins`` prints them under its table."""
    return [
        f"name clash: {name!r} is declared by "
        + " and ".join(map(_declarer, found))
        + "; each loads as its own plugin, select one by "
        + " or ".join(f"'{r.distribution}:{name}'" for r in found)
        for name, found in name_clashes(records).items()
    ]


def warn_clashes(records: Iterable[PluginRecord]) -> None:
    """One :class:`~kwplug.errors.PluginLoadWarning` per set of distributions that declare
    the same entry-point names, naming the names and the distributions."""
    names_by_declarers: dict[tuple[str, ...], list[str]] = {}
    third_party: dict[tuple[str, ...], str] = {}
    for name, found in name_clashes(records).items():
        declarers = tuple(map(_declarer, found))
        names_by_declarers.setdefault(declarers, []).append(name)
        third_party.setdefault(declarers, next(r.distribution for r in found if not r.builtin))
    for declarers, names in names_by_declarers.items():
        listed = ", ".join(map(repr, names))
        message = (
            f"kwplug: handler plugin names clash: {listed} "
            f"{'is' if len(names) == 1 else 'are'} declared by " + " and ".join(declarers) + ". "
            "Neither replaces the other: each is loaded as its own plugin, under its "
            "'distribution:name', and third-party defaults answer before built-ins; in a "
            "config file name one as 'distribution:name' (the bare name is ambiguous), and "
            "KWPLUG_PLUGINS/KWPLUG_BLOCK_PLUGINS given the bare name apply to all of them. "
            "A plugin author should rename the entry point"
        )
        warning = PluginLoadWarning(message, plugin=names[0], distribution=third_party[declarers])
        warnings.warn(warning, stacklevel=user_stacklevel())

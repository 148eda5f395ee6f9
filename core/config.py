"""Building an Accelerator's settings and handlers from a TOML file or a mapping.

The format, keyed by the entry-point names ``kwplug plugins`` shows::

    mixed_precision = "bf16"      # optional, Accelerator(mixed_precision=...)
    cpu = false                   # optional, Accelerator(cpu=...)

    [handlers.ddp]
    comm_hook = "bf16"
    bucket_cap_mb = 50

    [handlers.init_process_group]
    timeout = 120                 # seconds

Third-party handlers are configured the same way, by their entry-point name (or
``"distribution:name"`` when two distributions use the same name).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kwplug._plugins import discover
from kwplug.errors import ConfigError as ConfigError  # public here since 0.1
from kwplug.handler import KwargsHandler
from kwplug.validators import SHOWN, cut_values, shown

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ACCELERATOR_KEYS = ("mixed_precision", "cpu")


def load_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Read ``source`` and return the Accelerator keyword arguments it describes.

    Args:
        source: a path to a TOML file, or a mapping with the same structure.

    Returns:
        ``{"mixed_precision": ..., "cpu": ..., "kwargs_handlers": [...]}`` (only the keys given,
        ``kwargs_handlers`` always), handlers in the order of the ``[handlers.*]`` tables.

    Raises:
        ConfigError (a ``ValueError``): unreadable, non-UTF-8 or malformed TOML, arrays or
            tables nested more than :data:`MAX_DEPTH` levels, an unknown top-level key,
            an unknown handler name (the message lists the known ones), a table that is not a
            table, an unknown key in a handler table (lists the accepted keys), or a value the
            handler rejects (its ``TypeError``/``ValueError`` message, prefixed with the place).
    """
    if isinstance(source, Mapping):
        where, data = "<mapping>", dict(source)
    else:
        path = Path(source)
        where = str(path)
        data = _read_toml(path, where)
    _check_depth(data, where)

    unknown = sorted(set(data) - {*ACCELERATOR_KEYS, "handlers"})
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(map(_raw, unknown))}; accepted: "
            f"{', '.join((*ACCELERATOR_KEYS, 'handlers'))}",
            file=where,
            key=unknown[0],
        )
    kwargs: dict[str, Any] = {k: data[k] for k in ACCELERATOR_KEYS if k in data}
    if "cpu" in kwargs and not isinstance(kwargs["cpu"], bool):
        raise ConfigError(
            f"{where}: 'cpu' must be true or false, got {shown(kwargs['cpu'])}",
            file=where,
            key="cpu",
        )
    if kwargs.get("mixed_precision", "no") not in ("no", "fp16", "bf16"):
        raise ConfigError(
            f"{where}: 'mixed_precision' must be one of 'no', 'fp16', 'bf16', "
            f"got {shown(kwargs['mixed_precision'])}",
            file=where,
            key="mixed_precision",
        )
    tables = data.get("handlers", {})
    if not isinstance(tables, Mapping):
        raise ConfigError(
            f"{where}: 'handlers' must be a table of [handlers.<name>] tables",
            file=where,
            key="handlers",
        )
    kwargs["kwargs_handlers"] = [
        build_handler(name, options, where) for name, options in tables.items()
    ]
    return kwargs


#: Deepest nesting of arrays and tables accepted in a configuration (no handler needs more
#: than 3; a deeper value is a mistake or an attack on the parser's recursion).
MAX_DEPTH = 16


def _read_toml(path: Path, where: str) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"{where}: cannot read configuration: {exc.strerror}", file=where
        ) from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        table, key = _place_of_line(raw.decode("utf-8", "replace"), line)
        raise ConfigError(
            f"{where}: line {line}{_in(table, key)}: byte {raw[exc.start]:#04x} is not "
            "UTF-8; TOML files must be UTF-8 text",
            file=where,
            key=_dotted(table, key),
        ) from None
    try:
        data: dict[str, Any] = tomllib.loads(text)
        return data
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: malformed TOML: {exc}", file=where) from exc
    except RecursionError:  # tomllib recurses once per nested array or inline table
        line = _deepest_line(text)
        table, key = _place_of_line(text, line)
        raise ConfigError(
            f"{where}: line {line}{_in(table, key)}: arrays or tables nested too deeply "
            f"(at most {MAX_DEPTH} levels)",
            file=where,
            key=_dotted(table, key),
        ) from None


def _deepest_line(text: str) -> int:
    depths = [line.count("[") + line.count("{") for line in text.splitlines()] or [0]
    return depths.index(max(depths)) + 1


def _place_of_line(text: str, line: int) -> tuple[str | None, str | None]:
    # The [table] header above ``line`` and the key on it, to name them in an error.
    table = key = None
    for number, content in enumerate(text.splitlines()[:line], 1):
        stripped = content.strip()
        if stripped.startswith("[") and not stripped.startswith("[["):
            table = stripped.strip("[] ").split("]")[0].strip()
        elif "=" in stripped and number == line:
            key = stripped.split("=", 1)[0].strip()
    return table, key


def _raw(text: str) -> str:
    # A name shown unquoted (a table's, a key's), cut as validators.shown cuts values.
    if len(text) <= SHOWN:
        return text
    return f"{text[:SHOWN]}... ({len(text.encode('utf-8', 'surrogatepass'))} bytes)"


def _dotted(table: str | None, key: str | None) -> str | None:
    return ".".join(part for part in (table, key) if part) or None


def _in(table: str | None, key: str | None) -> str:
    parts = ([f"table [{table}]"] if table else []) + ([f"key {key!r}"] if key else [])
    return f" ({', '.join(parts)})" if parts else ""


def _check_depth(data: Mapping[str, Any], where: str) -> None:
    # Iterative, so that a deep mapping given directly cannot exhaust the stack either.
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, key, depth = stack.pop()
        if depth > MAX_DEPTH:
            table, _, leaf = key.rpartition(".")
            raise ConfigError(
                f"{where}{_in(table or None, leaf)}: arrays or tables nested more than "
                f"{MAX_DEPTH} levels deep",
                file=where,
                key=key,
            )
        if isinstance(value, Mapping):
            stack.extend((v, f"{key}.{k}" if key else str(k), depth + 1) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, key, depth + 1) for v in value)


def build_handler(name: str, options: Any, where: str = "<mapping>") -> KwargsHandler:
    """Construct the handler registered under entry-point ``name`` from ``options``.

    Raises:
        ConfigError: see :func:`load_config`.
    """
    place = f"{where}: [handlers.{_raw(name)}]"
    table = f"handlers.{name}"
    everything = discover()
    records = [r for r in everything if r.loaded and r.handler_class is not None]
    matches = [r for r in records if name in (r.name, f"{r.distribution}:{r.name}")]
    if len(matches) > 1:
        raise ConfigError(
            f"{place}: {shown(name)} names several handlers; use 'distribution:name', one of "
            + ", ".join(f"{r.distribution}:{r.name}" for r in matches),
            file=where,
            key=table,
        )
    if not matches:
        unavailable = [
            r for r in everything if not r.loaded and name in (r.name, f"{r.distribution}:{r.name}")
        ]
        if unavailable:  # installed, but not loaded: say why, not "unknown"
            r = unavailable[0]
            why = f"{r.status}: {r.error}" if r.error else r.status
            raise ConfigError(
                f"{place}: handler plugin {r.describe()} is installed but not loaded ({why}); "
                "see `kwplug plugins` and the KWPLUG_* loading controls",
                file=where,
                key=table,
            )
        known = ", ".join(sorted(r.name for r in records))
        raise ConfigError(
            f"{place}: no handler plugin named {shown(name)}; known: {known}", file=where, key=table
        )
    cls = matches[0].handler_class
    assert cls is not None
    if not isinstance(options, Mapping):
        raise ConfigError(
            f"{place} must be a table of options, got {shown(options)}", file=where, key=table
        )
    accepted = [f.name for f in attrs.fields(cls) if f.init]
    for key in options:
        if key not in accepted:
            raise ConfigError(
                f"{place}: unknown key {shown(key)} for {cls.__qualname__}; accepted: "
                f"{', '.join(accepted)}",
                file=where,
                key=f"{table}.{key}",
            )
    try:
        return cls(**options)
    except (TypeError, ValueError) as exc:
        # attrs' own validators raise TypeError/ValueError(message, attribute, ...), whose
        # str() is the tuple's repr (the Attribute's included): the message alone.
        text = exc.args[0] if len(exc.args) > 1 and isinstance(exc.args[0], str) else str(exc)
        # Validators name their field in quotes: point the error's key at it.
        field = next((k for k in options if f"'{k}'" in text), None)
        key = f"{table}.{field}" if field else table
        # attrs' own validators echo the value whole: a 20 MB one is cut (validators.shown).
        message = cut_values(text, options.values())
        raise ConfigError(f"{place}: {message}", file=where, key=key) from exc

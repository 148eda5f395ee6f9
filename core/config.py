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
        ConfigError (a ``ValueError``): unreadable or malformed TOML, an unknown top-level key,
            an unknown handler name (the message lists the known ones), a table that is not a
            table, an unknown key in a handler table (lists the accepted keys), or a value the
            handler rejects (its ``TypeError``/``ValueError`` message, prefixed with the place).
    """
    if isinstance(source, Mapping):
        where, data = "<mapping>", dict(source)
    else:
        path = Path(source)
        where = str(path)
        try:
            with path.open("rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(
                f"{where}: cannot read configuration: {exc.strerror}", file=where
            ) from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{where}: malformed TOML: {exc}", file=where) from exc

    unknown = sorted(set(data) - {*ACCELERATOR_KEYS, "handlers"})
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; accepted: "
            f"{', '.join((*ACCELERATOR_KEYS, 'handlers'))}",
            file=where,
            key=unknown[0],
        )
    kwargs: dict[str, Any] = {k: data[k] for k in ACCELERATOR_KEYS if k in data}
    if "cpu" in kwargs and not isinstance(kwargs["cpu"], bool):
        raise ConfigError(
            f"{where}: 'cpu' must be true or false, got {kwargs['cpu']!r}", file=where, key="cpu"
        )
    if kwargs.get("mixed_precision", "no") not in ("no", "fp16", "bf16"):
        raise ConfigError(
            f"{where}: 'mixed_precision' must be one of 'no', 'fp16', 'bf16', "
            f"got {kwargs['mixed_precision']!r}",
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


def build_handler(name: str, options: Any, where: str = "<mapping>") -> KwargsHandler:
    """Construct the handler registered under entry-point ``name`` from ``options``.

    Raises:
        ConfigError: see :func:`load_config`.
    """
    place = f"{where}: [handlers.{name}]"
    table = f"handlers.{name}"
    everything = discover()
    records = [r for r in everything if r.loaded and r.handler_class is not None]
    matches = [r for r in records if name in (r.name, f"{r.distribution}:{r.name}")]
    if len(matches) > 1:
        raise ConfigError(
            f"{place}: {name!r} names several handlers; use 'distribution:name', one of "
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
            f"{place}: no handler plugin named {name!r}; known: {known}", file=where, key=table
        )
    cls = matches[0].handler_class
    assert cls is not None
    if not isinstance(options, Mapping):
        raise ConfigError(
            f"{place} must be a table of options, got {options!r}", file=where, key=table
        )
    accepted = [f.name for f in attrs.fields(cls) if f.init]
    for key in options:
        if key not in accepted:
            raise ConfigError(
                f"{place}: unknown key {key!r} for {cls.__qualname__}; accepted: "
                f"{', '.join(accepted)}",
                file=where,
                key=f"{table}.{key}",
            )
    try:
        return cls(**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{place}: {exc}", file=where, key=table) from exc

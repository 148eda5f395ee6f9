"""Reading ``os.environ`` cheaply: :func:`get` and :func:`data`.

``os.environ.get(name)`` for a name the environment does not hold costs about 1.3 µs:
``os.environ`` is a ``Mapping`` whose ``get`` calls ``__getitem__``, which raises
``KeyError``, which ``get`` catches. Every ``Accelerator()`` reads about ten variables that are
usually unset (the loading controls, Accelerate's launcher switches, ``KWPLUG_TRACE_PLUGINS``),
still read every time so that a changed variable is seen (issue 31, goal 3). :func:`get`
looks the name up in the dictionary ``os.environ`` keeps (CPython's ``_data``, the encoded
names and values, which ``os.environ``'s own methods and ``os.putenv`` through it keep up to
date) and answers the same as ``os.environ.get``. The encoded form of each name asked is kept
(encoding it was half of a read's cost), with the encoding function it came from, so that an
``os.environ`` replaced by one that encodes otherwise is read with its own encoding.
"""

from __future__ import annotations

import os
from typing import Any, overload


def data() -> dict[Any, Any] | None:
    """The dictionary ``os.environ`` keeps the environment in (encoded names and values: two
    of them are equal exactly when the environments are), or ``None`` on a Python whose
    ``os.environ`` keeps it elsewhere, or when ``os.environ`` was replaced by another mapping."""
    found = getattr(os.environ, "_data", None)
    return found if isinstance(found, dict) else None


# Name -> (the encodekey function it was encoded with, the encoded name): kwplug reads a few
# fixed names; two threads filling the same name store equal values.
_encoded: dict[str, tuple[Any, Any]] = {}


@overload
def get(name: str) -> str | None: ...
@overload
def get(name: str, default: str) -> str: ...


def get(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, without the exception a missing name costs."""
    environ = os.environ
    found = getattr(environ, "_data", None)
    if not isinstance(found, dict):  # another Python, or os.environ replaced: its own get
        return environ.get(name, default)
    encodekey = environ.encodekey
    kept = _encoded.get(name)
    if kept is None or kept[0] is not encodekey:
        if len(_encoded) >= 256:  # a caller reading many names: keep the memory bounded
            _encoded.clear()
        kept = _encoded[name] = (encodekey, encodekey(name))
    value = found.get(kept[1])
    return default if value is None else environ.decodevalue(value)

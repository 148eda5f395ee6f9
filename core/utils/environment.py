"""Environment-variable helpers with Accelerate's names."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["parse_flag_from_env", "patch_environment", "str_to_bool"]

_TRUE = frozenset({"y", "yes", "t", "true", "on", "1"})
_FALSE = frozenset({"n", "no", "f", "false", "off", "0"})


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """``1`` for a true string (``y``, ``yes``, ``t``, ``true``, ``on``, ``1``), ``0`` for a
    false one (``n``, ``no``, ``f``, ``false``, ``off``, ``0``); case-insensitive. With
    ``to_bool=True`` (default ``False``), ``True``/``False`` instead, as Accelerate's.

    Raises:
        ValueError: any other string.
    """
    lowered = value.lower()
    if lowered in _TRUE:
        return True if to_bool else 1
    if lowered in _FALSE:
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}")


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """The boolean value of environment variable ``key`` (:func:`str_to_bool`), or ``default``
    when it is unset.

    Raises:
        ValueError: the variable is set to a string that is neither true nor false.
    """
    value = os.environ.get(key)
    return default if value is None else bool(str_to_bool(value))


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set environment variables for the duration of a ``with`` block.

    Keys are upper-cased and values converted with ``str``; on exit each variable gets back
    its previous value, or is removed if it had none (also when the block raises).
    """
    previous: dict[str, str | None] = {}
    for key, value in kwargs.items():
        name = key.upper()
        previous.setdefault(name, os.environ.get(name))
        os.environ[name] = str(value)
    try:
        yield
    finally:
        for name, old in previous.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old

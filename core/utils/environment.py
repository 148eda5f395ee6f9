"""Environment-variable helpers with Accelerate's names."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = [
    "clear_environment",
    "convert_dict_to_env_variables",
    "parse_flag_from_env",
    "patch_environment",
    "purge_accelerate_environment",
    "str_to_bool",
]

T = TypeVar("T")

# Accelerate's logger name for its warning (its tests and scripts capture it by that name);
# kwplug's set_verbosity sets the "accelerate" logger too.
logger = logging.getLogger("accelerate.utils.environment")
_FORBIDDEN = (";", "\n", "<", ">", " ")

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
def clear_environment() -> Iterator[None]:
    """Empty ``os.environ`` for the duration of a ``with`` block (Accelerate's): on exit the
    variables are exactly as before it (those the block added removed), also when it raises.
    """
    saved = os.environ.copy()
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


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


#: The prefixes of the variables :func:`purge_accelerate_environment` restores.
_PURGED_PREFIXES = ("ACCELERATE_", "KWPLUG_")


def purge_accelerate_environment(func_or_cls: T) -> T:
    """Decorator (Accelerate's): after each call of the decorated function -- or of each
    ``test*`` method of the decorated class and of its subclasses -- the ``ACCELERATE_*`` and
    ``KWPLUG_*`` environment variables are as they were before it: those it set are removed,
    those it changed or removed get their old value back (also when it raises).

    Two differences from Accelerate's: kwplug's own variables (``KWPLUG_PLUGINS``...) are
    restored too, since a test setting them affects the next one the same way; and a variable
    the function deleted is restored (Accelerate restores only those still set at the end).

    Args:
        func_or_cls: a function, or a class (``unittest.TestCase`` or a plain pytest class).

    Returns:
        The wrapped function, or the class itself with its test methods wrapped.
    """

    @contextlib.contextmanager
    def restored() -> Iterator[None]:
        before = {k: v for k, v in os.environ.items() if k.startswith(_PURGED_PREFIXES)}
        try:
            yield
        finally:
            for key in [k for k in os.environ if k.startswith(_PURGED_PREFIXES)]:
                if key not in before:
                    del os.environ[key]
            os.environ.update(before)

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with restored():
                return function(*args, **kwargs)

        wrapper._accelerate_is_purged_environment_wrapped = True  # type: ignore[attr-defined]
        return wrapper

    if not isinstance(func_or_cls, type):
        return wrap(func_or_cls)  # type: ignore[arg-type, return-value]
    decorated: type = func_or_cls

    def wrap_tests(cls: type) -> None:
        for name in dir(cls):
            method = getattr(cls, name)
            if (
                name.startswith("test")
                and callable(method)
                and not getattr(method, "_accelerate_is_purged_environment_wrapped", False)
            ):
                setattr(cls, name, wrap(method))

    wrap_tests(decorated)
    previous_hook = decorated.__dict__.get("__init_subclass__")

    def init_subclass(cls: type, **kwargs: Any) -> None:
        if previous_hook is not None:  # the decorated class's own hook still runs
            previous_hook.__func__(cls, **kwargs)
        else:
            super(decorated, cls).__init_subclass__(**kwargs)  # type: ignore[arg-type]
        wrap_tests(cls)

    decorated.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment, arg-type]
    return func_or_cls


def convert_dict_to_env_variables(current_env: dict[str, str]) -> list[str]:
    """``["KEY=value\\n", ...]`` for the items of ``current_env`` that are safe in an
    environment file (Accelerate's): an item whose key or value is empty or contains ``;``,
    a newline, ``<``, ``>`` or a space is left out, with a warning on Accelerate's logger of
    it, ``accelerate.utils.environment`` (whose level ``kwplug.logging.set_verbosity`` sets).

    Args:
        current_env: variable names to values (strings).
    """
    valid = []
    for key, value in current_env.items():
        text = key + value
        if key and value and not any(char in text for char in _FORBIDDEN):
            valid.append(f"{key}={value}\n")
        else:
            logger.warning(
                "WARNING: Skipping %s=%s as it contains forbidden characters or missing values.",
                key,
                value,
            )
    return valid

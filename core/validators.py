"""attrs validators shared by handlers, with messages that name the field and what it accepts.

They complement ``attrs.validators`` (``instance_of``, ``in_``, ``optional``...), which already
name the field, for the cases those get wrong for handler options: ``bool`` passing as an
``int``, and numeric ranges.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import attrs

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def number(*, integer: bool = False, gt: float | None = None, ge: float | None = None) -> Validator:
    """Validate a finite real number (never a ``bool``), optionally an ``int``, in a range.

    Raises (from the validator):
        TypeError: the value is not an ``int`` (or ``float`` unless ``integer``), or is a bool.
        ValueError: the value is NaN/infinite or outside the range.
    """
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    wanted = "an int" if integer else "a number (int or float)"
    bounds = []
    if gt is not None:
        bounds.append(f"> {gt}")
    if ge is not None:
        bounds.append(f">= {ge}")

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        number: float
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise TypeError(
                f"'{attribute.name}' must be {wanted}, got {value!r} of type {type(value).__name__}"
            )
        number = cast(float, value)  # int or float, checked above
        if not math.isfinite(number):
            raise ValueError(f"'{attribute.name}' must be finite, got {value!r}")
        if (gt is not None and not number > gt) or (ge is not None and not number >= ge):
            raise ValueError(f"'{attribute.name}' must be {' and '.join(bounds)}, got {value!r}")

    return check


def strict_bool(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Validate a ``bool`` (``0``/``1`` are rejected: they are usually a typo)."""
    if not isinstance(value, bool):
        raise TypeError(
            f"'{attribute.name}' must be True or False, got {value!r} of type "
            f"{type(value).__name__}"
        )


def optional_bool(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Validate ``None``, ``True`` or ``False``."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(
            f"'{attribute.name}' must be None, True or False, got {value!r} of type "
            f"{type(value).__name__}"
        )

"""attrs validators shared by handlers, and the one checker of option dictionaries.

The validators complement ``attrs.validators`` (``instance_of``, ``in_``, ``optional``,
``is_callable``, ``deep_mapping``...), which handlers use wherever their message says enough,
for what those get wrong for handler options: a ``bool`` passing as an ``int``, and ranges with
a message that says what is accepted. They are written the attrs way: small callable objects
``validator(instance, attribute, value)`` with a readable ``repr``, usable in
``attrs.field(validator=...)`` and inside ``attrs.validators.optional``/``and_``.

:class:`OptionSchema` checks a ``dict`` of named options (a communication hook's
``comm_state_option``, the profiler's ``schedule_option``, a plugin's hook options) with the
same validators, one per key: unknown keys, required keys and every value are checked in one place.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard, cast

import attrs

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]

__all__ = [
    "OptionSchema",
    "Validator",
    "is_int",
    "number",
    "optional_bool",
    "shown",
    "strict_bool",
]

#: How many characters of a value an error message shows (see :func:`shown`).
SHOWN = 200


def shown(value: Any, limit: int = SHOWN) -> str:
    """``repr(value)`` for an error message, cut after ``limit`` characters.

    A long string or bytes value is shown as its first ``limit`` characters and its size,
    ``'xxxx'... (20000000 bytes)``, so that a 20 MB value is never echoed whole; any other
    long ``repr`` as its first ``limit`` characters and its length.

    Args:
        value: what to show.
        limit: how many characters to keep, >= 1.

    Returns:
        The (possibly cut) representation.
    """
    if isinstance(value, (str, bytes)) and len(value) > limit:
        size = len(value.encode("utf-8", "surrogatepass")) if isinstance(value, str) else len(value)
        return f"{value[:limit]!r}... ({size} bytes)"
    if isinstance(value, int) and value.bit_length() > 4 * limit:  # repr is slow, or refused
        return f"an int of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    try:
        text = repr(value)
    except Exception as exc:  # a raising __repr__, a list nested 100,000 deep...
        return f"<a {type(value).__name__} whose repr raised {type(exc).__name__}>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def is_int(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is an ``int`` and not a ``bool`` (``True`` passing as ``1`` is
    usually a typo): the rule every integer argument of kwplug follows. Callers raise their
    own message (:func:`number` is the validator for attrs fields and option schemas)."""
    return isinstance(value, int) and not isinstance(value, bool)


def cut_values(message: str, values: Any) -> str:
    """``message`` with the ``repr`` of each long value in ``values`` replaced by
    :func:`shown` (for messages written by others, attrs' validators, that echo values)."""
    for value in values:
        if isinstance(value, (str, bytes)) and len(value) > SHOWN:
            message = message.replace(repr(value), shown(value))
    return message


#: The longest error message a cut one keeps, in characters (see :func:`cut_error`).
MESSAGE_LIMIT = 4000


def cut_error(exc: BaseException, values: Any) -> BaseException | None:
    """A copy of ``exc`` whose message echoes no long value, or ``None`` when it is short.

    attrs' validators (and torch's) put ``repr(value)`` in their messages, so a 20 MB string
    passed as a handler field or an ``Accelerator`` keyword would be echoed whole. Each long
    string or bytes in ``values`` (searched inside mappings, lists, tuples and sets, a few
    levels deep) is replaced by :func:`shown`; what is still over :data:`MESSAGE_LIMIT` is cut.

    Args:
        exc: the ``TypeError``/``ValueError`` raised.
        values: the arguments of the call that raised.

    Returns:
        An exception of ``exc``'s type with the cut message (its ``TypeError``/``ValueError``
        base when that type cannot be built from a message alone); raise it ``from None``, so
        that the long original is not printed as its context. ``None`` when ``exc``'s text is
        at most :data:`MESSAGE_LIMIT` characters.
    """
    if len(str(exc)) <= MESSAGE_LIMIT:
        return None
    # attrs' validators raise TypeError(message, attribute, type, value): the message alone.
    text = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
    message = cut_values(text, _long_strings(values, 3))
    if len(message) > MESSAGE_LIMIT:
        message = f"{message[:MESSAGE_LIMIT]}... ({len(message)} characters)"
    try:
        short = type(exc)(message)
    except Exception:  # a constructor with other arguments (attrs' NotCallableError)
        base = next((t for t in (TypeError, ValueError) if isinstance(exc, t)), None)
        if base is None:
            return None
        short = base(message)
    return short.with_traceback(exc.__traceback__)


def _long_strings(value: Any, depth: int) -> list[Any]:
    if isinstance(value, (str, bytes)):
        return [value] if len(value) > SHOWN else []
    if depth <= 0:
        return []
    if isinstance(value, Mapping):
        items: Any = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    else:
        return []
    return [s for item in items for s in _long_strings(item, depth - 1)]


@attrs.frozen
class _OptionKey:
    # Stands for the attrs.Attribute when OptionSchema runs a validator on an option's value:
    # validators (attrs's own too) only read ``.name``; ``name`` is the full label.
    name: str


def _label(attribute: Any) -> str:
    # A field is named quoted ('bucket_cap_mb'); an option by its schema's label.
    return attribute.name if isinstance(attribute, _OptionKey) else f"'{attribute.name}'"


@attrs.frozen(repr=False)
class _Number:
    integer: bool
    gt: float | None
    ge: float | None
    lt: float | None
    le: float | None
    finite: bool
    description: str | None

    def _bounds(self) -> str:
        limits = [("> ", self.gt), (">= ", self.ge), ("< ", self.lt), ("<= ", self.le)]
        return " and ".join(f"{op}{bound:g}" for op, bound in limits if bound is not None)

    def __call__(self, instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        # Every hook call re-validates each handler (kwplug._plugins._manager.revalidate):
        # the common case -- an in-range int or float -- is checked before any message or
        # label is built.
        if type(value) is int or (type(value) is float and not self.integer):
            number = cast(float, value)
            try:
                if (
                    (not self.finite or math.isfinite(number))
                    and (self.gt is None or number > self.gt)
                    and (self.ge is None or number >= self.ge)
                    and (self.lt is None or number < self.lt)
                    and (self.le is None or number <= self.le)
                ):
                    return
            except OverflowError:  # an int beyond float's range: _fail says so
                pass
        self._fail(attribute, value)

    def _fail(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        # The full check, with messages (subclasses of int and float take this path too).
        label = _label(attribute)
        kinds: tuple[type, ...] = (int,) if self.integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            wanted = self.description or ("an int" if self.integer else "a number (int or float)")
            raise TypeError(
                f"{label} must be {wanted}, got {shown(value)} of type {type(value).__name__}"
            )
        number = cast(float, value)  # int or float, checked above
        if self.finite and not _finite(number):
            raise ValueError(f"{label} must be {self.description or 'finite'}, got {shown(value)}")
        in_range = (
            (self.gt is None or number > self.gt)
            and (self.ge is None or number >= self.ge)
            and (self.lt is None or number < self.lt)
            and (self.le is None or number <= self.le)
        )  # False for NaN whatever the bounds
        if not in_range:
            raise ValueError(
                f"{label} must be {self.description or self._bounds()}, got {shown(value)}"
            )

    def __repr__(self) -> str:
        kind = "int" if self.integer else "number"
        bounds = self._bounds()
        return f"<{kind} validator{' ' + bounds if bounds else ''}>"


def _finite(number: float) -> bool:
    # An int too large for a float (10**400) is no usable setting: torch converts them.
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


def number(
    *,
    integer: bool = False,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    finite: bool = True,
    description: str | None = None,
) -> Validator:
    """Validate a real number (never a ``bool``), optionally an ``int``, in a range.

    Args:
        integer: accept only ``int`` (default: ``int`` or ``float``).
        gt: optional exclusive lower bound (``>``); NaN is never in range.
        ge: optional inclusive lower bound (``>=``).
        lt: optional exclusive upper bound (``<``).
        le: optional inclusive upper bound (``<=``).
        finite: refuse NaN and infinities (default ``True``), checked before the bounds.
        description: what the messages say is accepted (e.g. ``"a float in (0, 1]"``),
            instead of ``"an int"``/``"a number (int or float)"``, ``"finite"`` and the bounds.

    Returns:
        A validator ``(instance, attribute, value)`` for ``attrs.field`` or
        :class:`OptionSchema`.

    Raises (from the validator):
        TypeError: the value is not an ``int`` (or ``float`` unless ``integer``), or is a bool.
        ValueError: the value is NaN/infinite (with ``finite``) or outside the range.
    """
    return _Number(integer, gt, ge, lt, le, finite, description)


@attrs.frozen(repr=False)
class _Bool:
    allow_none: bool

    def __call__(self, instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) or (self.allow_none and value is None):
            return
        wanted = "None, True or False" if self.allow_none else "True or False"
        raise TypeError(
            f"{_label(attribute)} must be {wanted}, got {shown(value)} of type "
            f"{type(value).__name__}"
        )

    def __repr__(self) -> str:
        return f"<{'optional ' if self.allow_none else ''}strict bool validator>"


#: Validate a ``bool`` (``0``/``1`` are rejected: they are usually a typo). Raises
#: ``TypeError``.
strict_bool: Validator = _Bool(allow_none=False)

#: Validate ``None``, ``True`` or ``False``. Raises ``TypeError``.
optional_bool: Validator = _Bool(allow_none=True)


def _names(keys: Any) -> str:
    return ", ".join(map(shown, sorted(keys, key=str)))


@attrs.frozen
class OptionSchema:
    """What a ``dict`` of named options accepts, and the one check of such a dict.

    Used for the communication hooks' ``comm_state_option`` (built-in and plugins'),
    ``ProfileKwargs.schedule_option`` and plugins' options, so that every such dict refuses
    ``bool`` numbers, unknown keys and out-of-range values with the same messages.

    Attributes:
        validators: option name -> validator (e.g. :func:`number`, :data:`strict_bool`, an
            ``attrs.validators`` one); the messages name the option by ``label``.
        name: what the dict is called in messages, e.g. ``"comm_state_option"``.
        accepted: the accepted names, in the order messages list them; default: the keys of
            ``validators``. A name here without a validator is accepted unchecked.
        required: names that must be present.
        defaults: values of omitted options, returned by :meth:`check` and shown in messages.
        label: ``str.format`` template naming one option's value, with ``key`` (default
            ``"{name}[{key!r}]"``, e.g. ``comm_state_option['rank']``).
        unknown: template of the unknown-key message, with ``name``, ``names`` (the unknown
            keys, quoted) and ``accepted``.
        missing: template of the missing-key message, with ``name``, ``names`` and
            ``accepted``.
        accepted_item: template of one accepted name in ``{accepted}``, with ``key`` and
            ``default`` (e.g. ``"{key} (default {default!r})"``); default ``"{key!r}"``.
        relations: checks across options, each called with the checked values (a dict) once
            every value passed its validator; each raises ``ValueError`` naming the options.
    """

    validators: Mapping[str, Validator]
    name: str = "options"
    accepted: tuple[str, ...] | None = None
    required: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = attrs.field(factory=dict)
    label: str = "{name}[{key!r}]"
    unknown: str = "unknown option(s) {names} in {name}; accepted: {accepted}"
    missing: str = "{name} needs the option(s) {names}; accepted: {accepted}"
    accepted_item: str = "{key!r}"
    relations: tuple[Callable[[Mapping[str, Any]], None], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """The accepted option names, in order."""
        return self.accepted if self.accepted is not None else tuple(self.validators)

    def _accepted(self) -> str:
        return ", ".join(
            self.accepted_item.format(key=key, default=self.defaults.get(key)) for key in self.names
        )

    def _message(self, template: str, keys: list[Any]) -> str:
        return template.format(name=self.name, names=_names(keys), accepted=self._accepted())

    def check(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """Check ``options``: a mapping, no unknown key, every required key, valid values.

        Args:
            options: option name -> value.

        Returns:
            A new dict: :attr:`defaults` updated with ``options``.

        Raises:
            TypeError: ``options`` is not a mapping, or a value's type is refused.
            ValueError: an unknown or missing key (the message lists the accepted names), a
                value out of range, or values that one of :attr:`relations` refuses together.
        """
        if not isinstance(options, Mapping):
            raise TypeError(
                f"{self.name} must be a mapping of option name to value, got "
                f"{type(options).__name__}"
            )
        accepted = self.names
        unknown = [key for key in options if key not in accepted]
        if unknown:
            raise ValueError(self._message(self.unknown, unknown))
        missing = [key for key in self.required if key not in options]
        if missing:
            raise ValueError(self._message(self.missing, missing))
        values = {**self.defaults, **options}
        for key, value in values.items():
            validator = self.validators.get(key)
            if validator is not None:
                place = _OptionKey(self.label.format(name=self.name, key=key))
                validator(None, cast("attrs.Attribute[Any]", place), value)
        for relation in self.relations:
            relation(values)
        return values

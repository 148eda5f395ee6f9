"""``KwargsHandler``: the attrs base class of every handler, built-in or third-party."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import attrs

from kwplug.validators import cut_error

__all__ = ["AGREE", "TO_KWARGS", "KwargsHandler"]

#: Field metadata key: ``attrs.field(metadata={TO_KWARGS: False})`` keeps a field out of
#: :meth:`KwargsHandler.to_kwargs` (e.g. options consumed by kwplug itself, not by torch).
TO_KWARGS = "kwplug.to_kwargs"
#: Field metadata key: ``attrs.field(metadata={AGREE: False})`` keeps a field out of the
#: settings every rank must share (compared at each distributed ``Accelerator()``, see
#: :class:`kwplug.errors.RankMismatchError`); for a field that may differ per rank.
AGREE = "kwplug.agree"


@attrs.define
class KwargsHandler:
    """Base class of kwargs handlers: an attrs class whose instances are also pluggy plugins.

    Subclass it with ``@attrs.define`` and give every field a default, so that the class can be
    default-constructed (kwplug registers a default instance of each discovered handler class
    the user did not pass). Validators run at construction and on attribute assignment
    (``attrs.define`` sets ``on_setattr`` to run converters and validators), so a bad value
    raises ``TypeError``/``ValueError`` naming the field right away.

    Methods decorated with ``@kwplug.hookimpl`` answer the hooks of
    :class:`kwplug.hookspecs.HandlerSpec` when an instance is registered with an Accelerator.

    Attributes:
        register_default: class variable; when ``False``, kwplug does not register a default
            instance of this class, so it answers hooks only when the user passes an instance
            in ``kwargs_handlers`` (for opt-in wrappers such as FSDP).
        device_types: class variable; the ``torch.device(...).type`` strings this handler
            answers hooks for (e.g. ``frozenset({"xpu"})``), or ``None`` (default) for every
            device. Two third-party handlers registered by default that claim the same
            one-answer hook for the same device are a conflict
            (:class:`kwplug.errors.PluginConflictError`).
    """

    register_default: ClassVar[bool] = True
    device_types: ClassVar[frozenset[str] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A validator's message echoes the value (attrs' own do): a 20 MB string would be
        # printed whole. The methods attrs generates for a slotted class are in its dict
        # here; each is wrapped so that a long message is cut (validators.cut_error).
        for name in ("__init__", "__setattr__"):
            method = vars(cls).get(name)
            if callable(method) and _wrappable(method):
                setattr(cls, name, _cutting(method))

    @classmethod
    def is_attrs_class(cls) -> bool:
        """True when ``cls`` itself is decorated with ``@attrs.define`` (not just inheriting
        from one): an undecorated subclass would silently lose its fields."""
        return attrs.has(cls) and "__attrs_attrs__" in vars(cls)

    def to_dict(self) -> dict[str, Any]:
        """Return every field by name (shallow: values are not copied or converted)."""
        return {name: getattr(self, name) for name, _ in _fields(type(self))}

    def to_kwargs(self) -> dict[str, Any]:
        """Return the fields whose value differs from a default-constructed instance.

        Fields marked with ``metadata={kwplug.handler.TO_KWARGS: False}`` and fields that are
        not constructor arguments (``init=False``) are left out. The comparison is with the
        resolved values of ``cls()``, so ``InitProcessGroupKwargs().to_kwargs() == {}`` although
        its timeout is resolved to 600 s. Reads no environment variables.

        A ``@dataclasses.dataclass`` subclass (Accelerate's ``KwargsHandler`` is a dataclass
        mixin, and plugin authors coming from it write one) has its dataclass fields compared
        the same way; an ``@attrs.define`` subclass its attrs fields.

        Returns:
            ``dict`` of field name to value, in field definition order.
        """
        defaults = _default_values(type(self))
        return {
            name: value
            for name, kept in _fields(type(self))
            if kept and (value := getattr(self, name)) != defaults[name]
        }


def _wrappable(method: Callable[..., Any]) -> bool:
    # Not twice, and not a method using super() or __class__: attrs re-points that cell to
    # the slotted class only for the functions in the class's dict.
    code = getattr(method, "__code__", None)
    return not hasattr(method, "_kwplug_cut") and (
        code is None or "__class__" not in code.co_freevars
    )


def _cutting(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except (TypeError, ValueError) as exc:
            short = cut_error(exc, (args, kwargs))
            if short is None:
                raise
            raise short from None

    call._kwplug_cut = True  # type: ignore[attr-defined]
    return call


def _fields(cls: type[KwargsHandler]) -> list[tuple[str, bool]]:
    """``(name, goes into to_kwargs)`` of each constructor field of ``cls``: its dataclass
    fields when ``cls`` is a dataclass (the attrs fields it inherits from this base are
    none), else its attrs fields."""
    if dataclasses.is_dataclass(cls):
        return [
            (f.name, bool(f.metadata.get(TO_KWARGS, True)))
            for f in dataclasses.fields(cls)
            if f.init
        ]
    return [(f.name, bool(f.metadata.get(TO_KWARGS, True))) for f in attrs.fields(cls) if f.init]


_DEFAULTS: dict[type[KwargsHandler], dict[str, Any]] = {}


def _default_values(cls: type[KwargsHandler]) -> dict[str, Any]:
    # Built once per class: handler construction must not depend on the environment.
    if cls not in _DEFAULTS:
        default = cls()
        _DEFAULTS[cls] = {name: getattr(default, name) for name, _ in _fields(cls)}
    return _DEFAULTS[cls]

"""``KwargsHandler``: the attrs base class of every handler, built-in or third-party."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

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

    @classmethod
    def is_attrs_class(cls) -> bool:
        """True when ``cls`` itself is decorated with ``@attrs.define`` (not just inheriting
        from one): an undecorated subclass would silently lose its fields."""
        return attrs.has(cls) and "__attrs_attrs__" in vars(cls)

    def to_dict(self) -> dict[str, Any]:
        """Return every field by name (shallow: values are not copied or converted)."""
        return {f.name: getattr(self, f.name) for f in attrs.fields(type(self)) if f.init}

    def to_kwargs(self) -> dict[str, Any]:
        """Return the fields whose value differs from a default-constructed instance.

        Fields marked with ``metadata={kwplug.handler.TO_KWARGS: False}`` and fields that are
        not constructor arguments (``init=False``) are left out. The comparison is with the
        resolved values of ``cls()``, so ``InitProcessGroupKwargs().to_kwargs() == {}`` although
        its timeout is resolved to 600 s. Reads no environment variables.

        Returns:
            ``dict`` of field name to value, in field definition order.
        """
        defaults = _default_values(type(self))
        return {
            f.name: value
            for f in attrs.fields(type(self))
            if f.init
            and f.metadata.get(TO_KWARGS, True)
            and (value := getattr(self, f.name)) != defaults[f.name]
        }


_DEFAULTS: dict[type[KwargsHandler], dict[str, Any]] = {}


def _default_values(cls: type[KwargsHandler]) -> dict[str, Any]:
    # Built once per class: handler construction must not depend on the environment.
    if cls not in _DEFAULTS:
        _DEFAULTS[cls] = attrs.asdict(cls(), recurse=False)
    return _DEFAULTS[cls]

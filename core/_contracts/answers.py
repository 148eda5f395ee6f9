"""The types some hook answers take (re-exported by :mod:`kwplug.hookspecs`, their face):
:data:`AutocastFactory` (``autocast``) and :class:`DeviceChoice` (``select_device``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

#: An ``autocast`` answer: a callable returning a fresh autocast context manager.
AutocastFactory = Callable[[], AbstractContextManager[Any]]


def _is_device(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    import torch  # here, not at import: the hook contract loads without torch

    if not isinstance(value, torch.device):
        raise TypeError(f"DeviceChoice.device must be a torch.device, got {value!r}")


@attrs.frozen
class DeviceChoice:
    """A ``select_device`` answer: where this process trains, and what the run is called.

    Attributes:
        device: the ``torch.device`` (type and index) models and batches are moved to; its
            ``type`` is the ``device_type`` every other hook receives and picks the
            process-group backend (``InitProcessGroupKwargs``: ``gloo`` for a type torch
            knows no backend for). The answering plugin makes it current if it needs to.
        distributed_type: a :class:`kwplug.utils.DistributedType` value (``"NO"``,
            ``"MULTI_CPU"``, ``"XLA"``...) that ``Accelerator.distributed_type`` reports
            unless a sharding plugin says ``FSDP``; ``None`` (default): ``NO`` in one process,
            else ``MULTI_<device>``. Checked by the Accelerator (``ValueError`` names the
            accepted values).

    Raises:
        TypeError: ``device`` is not a ``torch.device``, ``distributed_type`` not a str.
    """

    device: torch.device = attrs.field(validator=_is_device)
    distributed_type: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str))
    )

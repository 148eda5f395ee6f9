"""``AutocastKwargs``: answers the ``autocast`` hook with ``torch.autocast``."""

from __future__ import annotations

import contextlib
import functools
from typing import ClassVar

import attrs
import torch

from kwplug.handler import KwargsHandler
from kwplug.hookspecs import AutocastFactory, hookimpl
from kwplug.validators import optional_bool, strict_bool


@attrs.define
class AutocastKwargs(KwargsHandler):
    """Options of ``torch.autocast`` for ``Accelerator.autocast()`` and the forward of every
    model prepared with mixed precision (``prepare()`` runs it under this context).

    The dtype comes from the Accelerator's ``mixed_precision``: ``"bf16"`` autocasts to
    ``torch.bfloat16``, ``"fp16"`` to ``torch.float16`` (on CPU too); with ``"no"`` the context
    is ``contextlib.nullcontext()``. The context is
    ``torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)``.

    Pass one per call to override the Accelerator's default and nest:
    ``with accelerator.autocast(AutocastKwargs(enabled=False)):`` runs in full precision inside
    an autocast region.

    Attributes:
        enabled: ``bool``, default ``True``; ``False`` disables autocast in the region.
        cache_enabled: ``bool`` or ``None`` (default: torch's default, ``True``); whether
            autocast caches the low-precision copies of weights inside the region.

    Raises:
        TypeError: a field is not a ``bool`` (``cache_enabled``: ``bool`` or ``None``).
    """

    DTYPES: ClassVar[dict[str, torch.dtype]] = {"bf16": torch.bfloat16, "fp16": torch.float16}

    enabled: bool = attrs.field(default=True, validator=strict_bool)
    cache_enabled: bool | None = attrs.field(default=None, validator=optional_bool)

    @hookimpl
    def autocast(self, device_type: str, mixed_precision: str) -> AutocastFactory | None:
        """The ``torch.autocast`` factory for ``device_type``; ``None`` when torch has no
        autocast for that device type (another plugin may answer)."""
        if mixed_precision == "no":
            return contextlib.nullcontext
        if not torch.amp.is_autocast_available(device_type):
            return None
        return functools.partial(
            torch.autocast,
            device_type,
            dtype=self.DTYPES[mixed_precision],
            enabled=self.enabled,
            cache_enabled=self.cache_enabled,
        )

"""``GradScalerKwargs``: answers the ``make_scaler`` hook with ``torch.amp.GradScaler``.

``torch.amp.GradScaler`` is a :class:`kwplug.precision.LossScaler` as it is (its ``scale``,
``unscale_``, ``step``, ``update``, ``get_scale``, ``state_dict`` and ``load_state_dict`` are
the protocol's), so the answer is the scaler itself: ``Accelerator.scaler`` stays the
``torch.amp.GradScaler`` Accelerate scripts read.
"""

from __future__ import annotations

import attrs
import torch

from kwplug.handler import KwargsHandler
from kwplug.hookspecs import hookimpl
from kwplug.precision import LossScaler
from kwplug.validators import number, strict_bool

#: The largest finite float32: ``torch.amp.GradScaler`` stores its scale in float32.
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@attrs.define
class GradScalerKwargs(KwargsHandler):
    """Options of ``torch.amp.GradScaler``, used when ``mixed_precision="fp16"``.

    The scaler is ``torch.amp.GradScaler(device_type, init_scale, growth_factor,
    backoff_factor, growth_interval, enabled)``; the Accelerator scales the loss in
    ``backward`` and steps optimizers through it. With ``"bf16"`` or ``"no"`` there is no
    scaler (bfloat16 has float32's range).

    Attributes:
        init_scale: ``float`` > 0 and at most float32's largest value (about 3.4e38: the
            scaler keeps its scale in a float32 tensor, where a larger one is ``inf`` and no
            step would ever be taken), default ``65536.0`` (2**16); the initial loss scale.
        growth_factor: ``float`` > 1, default ``2.0``; the scale is multiplied by it after
            ``growth_interval`` steps without inf/NaN gradients.
        backoff_factor: ``float`` in (0, 1), default ``0.5``; the scale is multiplied by it
            after a step with inf/NaN gradients (that step is skipped).
        growth_interval: ``int`` >= 1, default ``2000``; steps between growths.
        enabled: ``bool``, default ``True``; ``False`` builds a disabled scaler (no scaling).

    Raises:
        TypeError: a field has the wrong type (``bool`` is not accepted as a number).
        ValueError: a field is out of the range above.
    """

    init_scale: float = attrs.field(default=65536.0, validator=number(gt=0, le=_FLOAT32_MAX))
    growth_factor: float = attrs.field(default=2.0, validator=number(gt=1))
    backoff_factor: float = attrs.field(default=0.5, validator=number(gt=0))
    growth_interval: int = attrs.field(default=2000, validator=number(integer=True, ge=1))
    enabled: bool = attrs.field(default=True, validator=strict_bool)

    @backoff_factor.validator
    def _below_one(self, attribute: attrs.Attribute[float], value: float) -> None:
        if value >= 1:
            raise ValueError(f"'{attribute.name}' must be < 1, got {value!r}")

    @hookimpl
    def make_scaler(self, device_type: str, mixed_precision: str) -> LossScaler | None:
        """A ``torch.amp.GradScaler(device_type, ...)`` for ``"fp16"``, else ``None``."""
        if mixed_precision != "fp16":
            return None
        # Assigned to the protocol type so that mypy checks GradScaler implements it.
        scaler: LossScaler = torch.amp.GradScaler(
            device_type,
            init_scale=self.init_scale,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
            enabled=self.enabled,
        )
        return scaler

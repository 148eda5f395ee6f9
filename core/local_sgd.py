"""``LocalSGD``: train locally on each process and average the parameters every N steps.

The same class as ``accelerate.local_sgd.LocalSGD``. Inside the ``with`` block gradients are
not synchronised, so each process's model drifts; ``step()`` averages the parameters
(``torch.distributed.algorithms.model_averaging.utils.average_parameters``, one all-reduce of
all parameters flattened) every ``local_sgd_steps`` calls, and leaving the block averages once
more.

Gradient synchronisation is suppressed with ``accelerator.no_sync(model)`` when the
Accelerator has that method, else with the model's own ``no_sync()`` (DDP's). A model with
neither keeps synchronising its gradients: the processes then stay equal and the averaging
changes nothing, which costs time but not correctness.
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from kwplug.validators import is_int

__all__ = ["LocalSGD"]

#: Sharded or non-torch.distributed setups, whose parameters cannot be averaged as a whole.
_UNSUPPORTED = frozenset({"DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM"})


class LocalSGD:
    """Local SGD on top of an ``Accelerator``: average the model's parameters every
    ``local_sgd_steps`` optimizer steps instead of all-reducing gradients on every step.

    Use it around the training loop and call :meth:`step` after each optimizer step::

        with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd:
            for batch in loader:
                ...
                optimizer.step()
                local_sgd.step()

    In one process (or with ``enabled=False``) it does nothing but count steps. It uses only
    the Accelerator's public API: ``distributed``, ``wait_for_everyone()``, ``no_sync()``
    when present, and ``distributed_type`` when present.

    Args:
        accelerator: the ``kwplug.Accelerator`` the model was prepared with.
        model: the prepared model (for example the DDP wrapper).
        local_sgd_steps: ``int`` >= 1; steps between averagings (checked only when enabled).
        enabled: ``False`` turns local SGD off (the block is then a plain block).

    Attributes:
        enabled: whether averaging happens (``enabled`` and more than one process).
        num_steps: calls of :meth:`step` so far.

    Raises:
        NotImplementedError: the parameters are sharded (DTensor parameters, e.g. FSDP2, or a
            ``distributed_type`` of FSDP/DeepSpeed/XLA/Megatron-LM).
        TypeError: ``local_sgd_steps`` is not an int while enabled.
        ValueError: ``local_sgd_steps < 1`` while enabled.
    """

    def __init__(
        self,
        accelerator: Any,
        model: torch.nn.Module,
        local_sgd_steps: int,
        enabled: bool = True,
    ) -> None:
        kind = getattr(accelerator, "distributed_type", None)
        if kind is not None and str(getattr(kind, "value", kind)) in _UNSUPPORTED:
            raise NotImplementedError(
                f"LocalSGD averages whole parameters; it does not support distributed_type "
                f"{getattr(kind, 'value', kind)} (only plain data parallelism)"
            )
        if _has_sharded_parameters(model):
            raise NotImplementedError(
                "LocalSGD averages whole parameters; this model has sharded (DTensor) "
                "parameters, e.g. from FSDP2"
            )
        self.enabled = bool(enabled) and bool(accelerator.distributed)
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        if self.enabled:
            if not is_int(local_sgd_steps):
                raise TypeError(f"local_sgd_steps must be an int >= 1, got {local_sgd_steps!r}")
            if local_sgd_steps < 1:
                raise ValueError(f"local_sgd_steps must be an int >= 1, got {local_sgd_steps!r}")
        self._no_sync: contextlib.AbstractContextManager[Any] | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = self._suppress_gradient_sync()
            self._no_sync.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self.enabled or self._no_sync is None:
            return
        no_sync, self._no_sync = self._no_sync, None
        try:
            if exc_type is None:  # after an error the peers may not reach the collective
                self._average()
        finally:
            no_sync.__exit__(exc_type, exc, traceback)

    def step(self) -> None:
        """Count one optimizer step; average the parameters every ``local_sgd_steps`` steps."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    def _suppress_gradient_sync(self) -> contextlib.AbstractContextManager[Any]:
        accelerator_no_sync = getattr(self.accelerator, "no_sync", None)
        if callable(accelerator_no_sync):
            context: contextlib.AbstractContextManager[Any] = accelerator_no_sync(self.model)
            return context
        model_no_sync = getattr(self.model, "no_sync", None)
        if callable(model_no_sync):  # DistributedDataParallel.no_sync
            context = model_no_sync()
            return context
        return contextlib.nullcontext()

    def _average(self) -> None:
        self.accelerator.wait_for_everyone()
        parameters = list(self.model.parameters())
        if parameters:
            average_parameters(iter(parameters), dist.group.WORLD)  # type: ignore[arg-type]


def _has_sharded_parameters(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed tensors
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())

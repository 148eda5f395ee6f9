"""The state of an unfinished gradient accumulation, so that ``save_state`` between two
micro-batches of ``Accelerator.accumulate`` resumes bitwise exactly.

Between the synchronising steps of an accumulation the prepared models' ``.grad`` tensors
hold the sum of the micro-batches seen so far (under DDP each rank's own, unsynchronised
sum). :class:`PendingAccumulation` saves, per rank, those gradients, the ``GradientState``
position (micro-batch count, ``sync_gradients``) and each prepared optimizer's per-step
flag (fp16 step skipped), and puts them back on load. At a synchronising boundary nothing
is pending and nothing is written; loading a checkpoint without the file resets the
position to a boundary and leaves ``.grad`` alone (as Accelerate does).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kwplug.checkpoint import _sharded as sharded
from kwplug.errors import CheckpointError

if TYPE_CHECKING:
    from kwplug.checkpoint._sources import GradientPosition
    from kwplug.optimizer import AcceleratedOptimizer, ScalerUpdates


class PendingAccumulation:
    """torch ``Stateful`` of one rank's unfinished gradient accumulation.

    Args:
        world_size: the number of processes (local gradients belong to this many ranks).
        gradient_state: the Accelerator's ``GradientState``.
        modules: the prepared models, unwrapped (their parameters hold the gradients).
        optimizers: the prepared optimizers.
        scaler_updates: the pending ``GradScaler.update()`` shared by the optimizers
            (fp16), or ``None``.
    """

    def __init__(
        self,
        *,
        world_size: int,
        gradient_state: GradientPosition,
        modules: Sequence[torch.nn.Module],
        optimizers: Sequence[AcceleratedOptimizer],
        scaler_updates: ScalerUpdates | None,
    ) -> None:
        self.world_size, self.gradient_state = world_size, gradient_state
        self.modules, self.optimizers = modules, optimizers
        self.scaler_updates = scaler_updates

    @property
    def pending(self) -> bool:
        """Whether an optimizer step is still to come in the current accumulation."""
        return not self.gradient_state.sync_gradients

    def state_dict(self) -> dict[str, Any]:
        """The unfinished accumulation, or ``{}`` at a synchronising boundary (not written).

        A ``GradScaler.update()`` still owed to the last step (only some optimizers
        stepped) is made now, so that the saved scaler is the one the next step uses.

        Raises:
            CheckpointError: gradients are pending on a sharded (``DTensor``) model, whose
                wrapper keeps them outside ``.grad``; or an optimizer's gradients were
                unscaled and it has not stepped yet (save after ``optimizer.step()``).
        """
        if self.scaler_updates is not None:
            self.scaler_updates.flush()
        if not self.pending:
            return {}
        if any(getattr(opt, "_unscaled", False) for opt in self.optimizers):
            raise CheckpointError(
                "save_state between unscaling the gradients (clip_grad_norm_, "
                "unscale_gradients) and optimizer.step(): save after the optimizer step"
            )
        grads: list[dict[str, torch.Tensor]] = []
        for module in self.modules:
            if sharded.is_sharded(module):
                raise CheckpointError(
                    f"save_state in the middle of a gradient accumulation of the sharded model "
                    f"{type(module).__qualname__}: its wrapper keeps the accumulated gradients "
                    "outside .grad; save after a synchronising step (accelerator.sync_gradients)"
                )
            grads.append({n: p.grad for n, p in module.named_parameters() if p.grad is not None})
        return {
            "world_size": self.world_size,
            "gradient_state": self.gradient_state.state_dict(),
            "grads": grads,
            "step_was_skipped": [bool(getattr(o, "_is_overflow", False)) for o in self.optimizers],
        }

    def check(self, state_dict: Any, path: Path) -> None:
        """Refuse a saved accumulation that does not fit this run.

        Raises:
            CheckpointError: another number of processes (each rank's gradients are its own
                partial sum), models or optimizers, or a gradient of another shape or dtype.
        """
        keys = ("world_size", "gradient_state", "grads", "step_was_skipped")
        if not isinstance(state_dict, dict) or any(k not in state_dict for k in keys):
            raise CheckpointError(f"{path} does not hold a kwplug accumulation state", path)
        if state_dict["world_size"] != self.world_size:
            raise CheckpointError(
                f"{path} was saved in the middle of a gradient accumulation by "
                f"{state_dict['world_size']} processes, this run has {self.world_size}: the "
                "local gradients cannot be redistributed",
                path,
            )
        counts = (len(state_dict["grads"]), len(state_dict["step_was_skipped"]))
        if counts != (len(self.modules), len(self.optimizers)):
            raise CheckpointError(
                f"{path} holds the accumulation of {counts[0]} model(s) and {counts[1]} "
                f"optimizer(s); {len(self.modules)} and {len(self.optimizers)} are prepared",
                path,
            )
        for module, saved in zip(self.modules, state_dict["grads"], strict=True):
            params = dict(module.named_parameters())
            for name, grad in saved.items():
                param = params.get(name)
                if param is None or grad.shape != param.shape or grad.dtype != param.dtype:
                    raise CheckpointError(
                        f"{path}: the saved gradient {name!r} ({grad.dtype}, "
                        f"{tuple(grad.shape)}) fits no parameter of the prepared model",
                        path,
                    )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Put the saved accumulation back (``{}``: resume at a boundary, grads untouched)."""
        if not state_dict:
            self.gradient_state.load_state_dict({"step": 0, "sync_gradients": True})
            return
        self.gradient_state.load_state_dict(state_dict["gradient_state"])
        for module, saved in zip(self.modules, state_dict["grads"], strict=True):
            for name, param in module.named_parameters():
                grad = saved.get(name)
                if grad is None:
                    param.grad = None
                elif param.grad is None:  # a fresh process: no gradient yet
                    param.grad = grad.to(param.device, copy=True)
                else:  # in place: a wrapper may keep a view of it (DDP bucket views)
                    param.grad.copy_(grad)
        for optimizer, skipped in zip(self.optimizers, state_dict["step_was_skipped"], strict=True):
            optimizer._is_overflow = bool(skipped)

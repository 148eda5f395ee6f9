"""The optimizer wrapper used when a gradient scaler is active."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class ScaledOptimizer(torch.optim.Optimizer):
    """Steps an optimizer through a ``torch.amp.GradScaler``.

    ``step()`` is ``scaler.step(optimizer)`` then ``scaler.update()``: the step is skipped
    when the scaled gradients hold inf/NaN, and the scale is adjusted. Every other attribute
    (``param_groups``, ``state``, ``zero_grad``, ``state_dict``, ...) is the wrapped
    optimizer's. Without a scaler, ``Accelerator.prepare`` returns the optimizer itself, so
    training in fp32 or bf16 pays nothing for this class.

    Attributes:
        optimizer: the wrapped ``torch.optim.Optimizer``.
        scaler: the ``torch.amp.GradScaler``.
    """

    # Subclassing Optimizer (without its __init__) keeps isinstance checks, e.g. in LR
    # schedulers, working on the prepared optimizer.
    def __init__(  # pylint: disable=super-init-not-called
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
    ) -> None:
        self.optimizer = optimizer
        self.scaler = scaler
        self._last_scale = -1.0

    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None
    ) -> float | None:
        """``scaler.step(optimizer, closure)`` followed by ``scaler.update()``."""
        self._last_scale = self.scaler.get_scale()
        if closure is None:
            result = self.scaler.step(self.optimizer)
        else:
            result = self.scaler.step(self.optimizer, closure)
        self.scaler.update()
        return result

    @property
    def step_was_skipped(self) -> bool:
        """True when the last ``step()`` was skipped because of inf/NaN gradients."""
        return self.scaler.get_scale() < self._last_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad(set_to_none)``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()``."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's ``load_state_dict``."""
        self.optimizer.load_state_dict(state_dict)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's ``param_groups``."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's per-parameter ``state``."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's ``defaults``."""
        return self.optimizer.defaults

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"ScaledOptimizer({self.optimizer!r})"

"""The wrapper every learning-rate scheduler prepared by an ``Accelerator`` goes through."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from kwplug.optimizer import AcceleratedOptimizer


class SchedulerGradientState(Protocol):
    """What the scheduler wrapper reads from the Accelerator's gradient state."""

    @property
    def sync_gradients(self) -> bool:
        """``True`` on a step that ends with an optimizer step."""

    @property
    def adjust_scheduler(self) -> bool:
        """Count accumulation steps in the scheduler's ``_step_count``."""


class AcceleratedScheduler:
    """Steps a ``torch.optim.lr_scheduler.LRScheduler`` only when its optimizers stepped.

    Stepping follows Accelerate's ``AcceleratedScheduler``: ``step()`` does nothing on an
    accumulation step that does not synchronise gradients (but adds one to the scheduler's
    ``_step_count`` when the ``GradientAccumulationPlugin`` was given ``adjust_scheduler=True``),
    nothing when one of the optimizers skipped its step (fp16 overflow), and otherwise steps
    the scheduler ``num_processes`` times -- each process consumed ``num_processes`` times the
    batch the schedule was written for -- or once with ``split_batches=True``. A ``OneCycleLR``
    is not stepped past its ``total_steps``. With ``step_with_optimizer=False`` every call
    steps the scheduler once.

    Args:
        scheduler: the scheduler to wrap.
        optimizers: the prepared optimizers whose skipped steps it follows.
        gradient_state: the Accelerator's gradient state.
        num_processes: ``int`` >= 1; scheduler steps per optimizer step without
            ``split_batches``.
        step_with_optimizer: default ``True``; see above.
        split_batches: default ``False``; see above.

    Attributes:
        scheduler: the wrapped scheduler; the other arguments are kept under their names.
    """

    def __init__(
        self,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        optimizers: Sequence[Any],
        gradient_state: SchedulerGradientState,
        num_processes: int = 1,
        step_with_optimizer: bool = True,
        split_batches: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = list(optimizers)
        self.gradient_state = gradient_state
        self.num_processes = num_processes
        self.step_with_optimizer = step_with_optimizer
        self.split_batches = split_batches
        self._plan: tuple[bool, int] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        # Any assignment (num_processes, split_batches, optimizers...) invalidates what step()
        # precomputed from the attributes.
        object.__setattr__(self, name, value)
        if name != "_plan":
            object.__setattr__(self, "_plan", None)

    def _make_plan(self) -> tuple[bool, int]:
        # (step on every call, scheduler steps per optimizer step): what step() would
        # otherwise work out at each call.
        plan = (not self.step_with_optimizer, 1 if self.split_batches else self.num_processes)
        self._plan = plan
        return plan

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the scheduler as described on the class."""
        plan = self._plan
        if plan is None:
            plan = self._make_plan()
        scheduler = self.scheduler
        if plan[0]:
            scheduler.step(*args, **kwargs)
            return
        state = self.gradient_state
        if not state.sync_gradients:
            if state.adjust_scheduler:
                scheduler._step_count += 1
            return
        for opt in self.optimizers:  # a plain loop: no generator per step
            # A prepared optimizer's flag read directly (no property call per step): it is
            # Accelerate's `_is_overflow`, which code written for Accelerate sets itself.
            if type(opt) is AcceleratedOptimizer:
                if opt._is_overflow:
                    return
            elif getattr(opt, "step_was_skipped", False):
                return
        # OneCycleLR's limit, else None. Read with getattr, never through the scheduler's
        # __dict__: touching an instance's __dict__ makes CPython 3.11+ replace its inline
        # attribute values with a real dict, and every attribute access of torch's own
        # step() then costs more (about 4,000 instructions per step, callgrind).
        if plan[1] == 1 and not args and not kwargs:  # the usual case
            total = getattr(scheduler, "total_steps", None)
            if total is None or scheduler._step_count <= total:
                scheduler.step()
            return
        for _ in range(plan[1]):
            total = getattr(scheduler, "total_steps", None)
            if total is None or scheduler._step_count <= total:
                scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[Any]:
        """The wrapped scheduler's ``get_last_lr()``."""
        return self.scheduler.get_last_lr()

    def print_lr(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped scheduler's ``print_lr``, as Accelerate's.

        Raises:
            AttributeError: the scheduler has none (torch 2.13's ``LRScheduler`` has not).
        """
        scheduler: Any = self.scheduler
        return scheduler.print_lr(*args, **kwargs)

    def get_lr(self) -> Any:
        """The wrapped scheduler's ``get_lr()``."""
        return self.scheduler.get_lr()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's ``state_dict()``."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped scheduler's ``load_state_dict``."""
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # during unpickling, before __dict__ is filled
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"

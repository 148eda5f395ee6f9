"""The wrapper every optimizer prepared by an ``Accelerator`` goes through.

:class:`AcceleratedOptimizer` skips ``step`` and ``zero_grad`` while gradients are being
accumulated (``Accelerator.accumulate``), and steps through the loss scaler (the
``make_scaler`` answer, a :class:`kwplug.precision.LossScaler`) when there is one.
:class:`ScalerUpdates` makes the optimizers of one Accelerator share one ``update()`` of the
loss scaler per training step. Only :class:`~kwplug.precision.LossScaler` methods are called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from kwplug.precision import LossScaler
from kwplug.utils.structures import send_to_device

#: torch's own ``Optimizer.zero_grad``, which ``torch._disable_dynamo`` wraps in a
#: ``(*args, **kwargs)`` function: a keyword argument costs a dict per call there, a
#: positional one does not.
_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad


class SyncState(Protocol):
    """What the wrapper reads from the Accelerator: whether this step synchronises gradients
    (``False`` inside ``accumulate()`` before the last micro-batch)."""

    @property
    def sync_gradients(self) -> bool:
        """``True`` on a step that ends with an optimizer step."""


class ScalerUpdates:
    """Calls the loss scaler's ``update()`` once per training step for every optimizer sharing
    it.

    ``update`` must follow the ``step`` of *every* optimizer of the step (as
    ``torch.amp.GradScaler`` requires):
    updating after each one would unscale the next optimizer's gradients with a scale they
    were not multiplied by, grow the scale once per optimizer after a clean step and undo an
    overflow's back-off. The update runs when each member optimizer has stepped, or -- when
    only some of them step (alternating optimizers) -- at the start of the next step
    (:meth:`flush`: ``Accelerator.backward``, gradient clipping, or a second step of one
    optimizer).

    Args:
        backend: the shared :class:`~kwplug.precision.LossScaler` (e.g. a
            ``torch.amp.GradScaler``).

    Attributes:
        backend: as given.
    """

    def __init__(self, backend: LossScaler) -> None:
        self.backend = backend
        self._members: set[int] = set()
        self._stepped: set[int] = set()

    def add(self, optimizer: AcceleratedOptimizer) -> None:
        """Count ``optimizer`` among those that step before the shared update."""
        self._members.add(id(optimizer))

    def discard(self, optimizer: AcceleratedOptimizer) -> None:
        """Stop waiting for ``optimizer`` (it is no longer prepared)."""
        self._members.discard(id(optimizer))
        self._stepped.discard(id(optimizer))

    def stepping(self, optimizer: AcceleratedOptimizer) -> None:
        """Called before ``optimizer`` steps: a second step of one optimizer is a new step."""
        if id(optimizer) in self._stepped:
            self.flush()

    def stepped(self, optimizer: AcceleratedOptimizer) -> None:
        """Called after ``optimizer`` stepped; updates once every member has."""
        self._stepped.add(id(optimizer))
        if self._stepped >= self._members:
            self.flush()

    @property
    def scaler(self) -> LossScaler:
        """The earlier name of :attr:`backend` (kept readable)."""
        return self.backend

    def flush(self) -> None:
        """The loss scaler's ``update()`` if any optimizer stepped since the last update."""
        if self._stepped:
            self._stepped.clear()
            self.backend.update()

    def __getstate__(self) -> dict[str, Any]:
        # Members are kept by id(), which a copy does not share: each unpickled optimizer adds
        # itself again (AcceleratedOptimizer.__setstate__).
        return {"backend": self.backend, "_members": set(), "_stepped": set()}


class AcceleratedOptimizer(torch.optim.Optimizer):
    """An optimizer prepared by an ``Accelerator``.

    ``step()`` and ``zero_grad()`` do nothing on the micro-batches of a gradient accumulation
    that do not end with an optimizer step (``gradient_state.sync_gradients`` false), as
    Accelerate's ``AcceleratedOptimizer``. With a loss scaler, ``step()`` is its
    ``step(optimizer)`` (:meth:`kwplug.precision.LossScaler.step`), which may skip the
    optimizer's step -- ``torch.amp.GradScaler`` does when the scaled gradients hold inf/NaN
    (:attr:`step_was_skipped`) -- with one ``update()`` per training step shared by every
    optimizer of the Accelerator (:class:`ScalerUpdates`). Every other attribute
    (``param_groups``, ``state``, ``state_dict``, ...) is the wrapped optimizer's.

    A prepared optimizer pickles (``pickle``, ``copy.deepcopy``) with the optimizer it wraps,
    its scaler and its state; the copy steps and skips steps as the original.

    Args:
        optimizer: the ``torch.optim.Optimizer`` to wrap.
        device_placement: Accelerate's, default ``True``: with a ``device``, the optimizer's
            existing state (``state_dict()``, e.g. loaded before ``prepare``) is moved there
            (``optimizer.load_state_dict`` of the moved state, as Accelerate); ``False`` leaves
            it where it is.
        scaler: the :class:`~kwplug.precision.LossScaler` (``torch.amp.GradScaler`` under
            fp16), or ``None`` (default).
        gradient_state: whether the current step synchronises gradients; ``None`` (default):
            every step does.
        scaler_updates: the :class:`ScalerUpdates` shared with the other optimizers using
            ``scaler``; default: one of its own.
        device: where ``device_placement`` moves the state (the ``Accelerator`` passes its
            ``device``); default ``None``: nowhere.

    Attributes:
        optimizer: the wrapped optimizer.
        scaler: the loss scaler or ``None``.
        gradient_state: as given.
    """

    # Subclassing Optimizer (without its __init__) keeps isinstance checks, e.g. in LR
    # schedulers, working on the prepared optimizer.
    def __init__(  # pylint: disable=super-init-not-called
        self,
        optimizer: torch.optim.Optimizer,
        device_placement: bool = True,
        scaler: LossScaler | None = None,
        gradient_state: SyncState | None = None,
        scaler_updates: ScalerUpdates | None = None,
        *,
        device: torch.device | None = None,
    ) -> None:
        if not isinstance(device_placement, bool):
            raise TypeError(
                f"device_placement must be a bool, got {type(device_placement).__name__}"
            )
        if device_placement and device is not None and optimizer.state:
            moved = send_to_device(optimizer.state_dict(), device)
            optimizer.load_state_dict(moved)
        self.optimizer = optimizer
        self.device_placement = device_placement
        self.scaler = scaler
        self.gradient_state = gradient_state
        self._is_overflow = False
        self._unscaled = False
        self._ran = False
        self._updates: ScalerUpdates | None = None
        if scaler is not None:
            self._updates = scaler_updates or ScalerUpdates(scaler)
            self._follow_steps()

    def _follow_steps(self) -> None:
        assert self._updates is not None
        self._updates.add(self)
        # A loss scaler skips a step by not calling optimizer.step() (GradScaler on
        # inf/NaN); a post-step hook (public torch API) tells whether it ran.
        register = getattr(self.optimizer, "register_step_post_hook", None)
        if register is not None:
            register(self._record_step)

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim.Optimizer.__getstate__ keeps only defaults/state/param_groups, which
        # are the wrapped optimizer's here: keep the wrapper's own attributes instead.
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._updates is not None:
            # The wrapped optimizer's step hooks are not pickled (torch keeps only its state).
            self._follow_steps()

    def _record_step(self, *_: Any) -> None:
        self._ran = True

    @property
    def _syncing(self) -> bool:
        return self.gradient_state is None or self.gradient_state.sync_gradients

    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None
    ) -> float | None:
        """Step the wrapped optimizer, through the loss scaler when there is one; nothing on
        an accumulation step that does not synchronise gradients."""
        state = self.gradient_state  # read inline: a property call per step costs more
        if state is not None and not state.sync_gradients:
            return None
        updates = self._updates
        if updates is None:
            return self.optimizer.step() if closure is None else self.optimizer.step(closure)
        updates.stepping(self)
        self._ran = False
        result: float | None = (
            updates.backend.step(self.optimizer)
            if closure is None
            else updates.backend.step(self.optimizer, closure)
        )
        self._is_overflow = not self._ran
        self._unscaled = False
        updates.stepped(self)
        return result

    def unscale_gradients(self) -> None:
        """The loss scaler's ``unscale_(optimizer)`` once per optimizer step (later calls, and
        calls without a loss scaler, do nothing)."""
        updates = self._updates
        if updates is None or self._unscaled:
            return
        updates.stepping(self)  # a pending update belongs to the previous step
        updates.backend.unscale_(self.optimizer)
        self._unscaled = True

    @property
    def step_was_skipped(self) -> bool:
        """True when the last synchronising ``step()`` was skipped by the loss scaler (its
        ``step`` did not call ``optimizer.step()``; ``torch.amp.GradScaler``: the gradients
        held inf/NaN)."""
        return self._is_overflow

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """``optimizer.zero_grad(set_to_none)`` (default ``True``) on a synchronising step;
        nothing while gradients accumulate."""
        state = self.gradient_state
        if state is None or state.sync_gradients:
            zero_grad = self.optimizer.zero_grad
            if getattr(zero_grad, "__func__", None) is _TORCH_ZERO_GRAD:
                zero_grad(True if set_to_none is None else set_to_none)
            else:
                zero_grad(set_to_none=True if set_to_none is None else set_to_none)

    def train(self) -> None:
        """``optimizer.train()`` when the wrapped optimizer has one (schedule-free)."""
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()  # type: ignore[attr-defined]

    def eval(self) -> None:
        """``optimizer.eval()`` when the wrapped optimizer has one (schedule-free)."""
        if callable(getattr(self.optimizer, "eval", None)):
            self.optimizer.eval()  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()``."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's ``load_state_dict``."""
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The wrapped optimizer's ``add_param_group``."""
        self.optimizer.add_param_group(param_group)

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
        if name == "optimizer":  # during unpickling, before __dict__ is filled
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


#: The earlier name of :class:`AcceleratedOptimizer` (kept importable).
ScaledOptimizer = AcceleratedOptimizer

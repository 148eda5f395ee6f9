"""The loss-scaling protocol: what the ``Accelerator`` calls to scale, unscale and step.

A ``make_scaler`` hook answer (:meth:`kwplug.hookspecs.HandlerSpec.make_scaler`) is a
:class:`LossScaler`. The core calls nothing else on it: ``Accelerator.backward`` scales the
loss with :meth:`~LossScaler.scale`, gradient clipping unscales with
:meth:`~LossScaler.unscale_` (and reads :meth:`~LossScaler.get_scale` while gradients
accumulate), ``optimizer.step()`` is :meth:`~LossScaler.step` followed, once every optimizer of
the training step has stepped, by one :meth:`~LossScaler.update`, and ``save_state`` /
``load_state`` go through :meth:`~LossScaler.state_dict` / :meth:`~LossScaler.load_state_dict`.

``torch.amp.GradScaler`` is a :class:`LossScaler` as it is (the built-in ``GradScalerKwargs``
answers with one), so another loss-scaling rule, an FP8 recipe or a device whose scaler
differs is a plugin answering ``make_scaler`` with its own object -- no change to the core.
The answer is checked once, at ``Accelerator`` construction (:func:`check_loss_scaler`); the
training step calls its methods directly (no hook call per step).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

#: The values of ``mixed_precision`` (``Accelerator``, ``AcceleratorState``); also
#: ``kwplug.accelerator.MIXED_PRECISION``.
MIXED_PRECISION = ("no", "fp16", "bf16")

#: The methods the core calls on a ``make_scaler`` answer.
METHODS = ("scale", "unscale_", "step", "update", "get_scale", "state_dict", "load_state_dict")


@runtime_checkable
class LossScaler(Protocol):
    """What a ``make_scaler`` answer implements; ``torch.amp.GradScaler`` is one.

    One object serves every optimizer of an ``Accelerator`` and lives for one run (it holds
    training state: the scale). Per training step the core calls, in this order:
    :meth:`scale` (each ``backward``), :meth:`unscale_` (at most once per optimizer, before
    clipping), :meth:`step` (once per optimizer), then :meth:`update` once, after the last
    optimizer of the step has stepped (or, when only some optimizers step, at the start of the
    next step).
    """

    def scale(self, outputs: torch.Tensor) -> torch.Tensor:
        """Return the loss to call ``backward()`` on (``loss * scale`` for loss scaling).

        Args:
            outputs: the loss of the micro-batch (already divided by
                ``gradient_accumulation_steps``).

        Returns:
            A tensor whose ``backward()`` produces the (scaled) gradients.
        """

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring the gradients of ``optimizer``'s parameters to their true values, in place.

        Called at most once per optimizer step (the core keeps track); :meth:`step` must not
        unscale again after it.

        Args:
            optimizer: the wrapped ``torch.optim.Optimizer`` (not kwplug's wrapper).
        """

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Step ``optimizer`` with the true gradients (unscaling them first unless
        :meth:`unscale_` did), or skip the step by not calling ``optimizer.step()``.

        The core tells a skipped step (``AcceleratedOptimizer.step_was_skipped``,
        ``Accelerator.optimizer_step_was_skipped``) by whether ``optimizer.step()`` ran
        (``torch.optim.Optimizer.register_step_post_hook``), so the backend needs not report it.

        Args:
            optimizer: the wrapped ``torch.optim.Optimizer``.
            *args: passed to ``optimizer.step`` (a closure, when the user gave one).
            **kwargs: passed to ``optimizer.step``.

        Returns:
            What ``optimizer.step`` returned, or ``None`` when skipped.
        """

    def update(self) -> None:
        """Adjust the scale after the training step (once, whatever the number of
        optimizers)."""

    def get_scale(self) -> float:
        """The current scale factor (``1.0`` when not scaling): the core divides the norm of
        gradients still accumulating by it (``Accelerator.clip_grad_norm_``)."""

    def state_dict(self) -> dict[str, Any]:
        """The state ``save_state`` writes (``scaler.safetensors``): tensors and plain data."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (``load_state``)."""


def check_loss_scaler(answer: Any, provider: str) -> LossScaler | None:
    """Check a ``make_scaler`` answer once, at ``Accelerator`` construction.

    Args:
        answer: what the hook returned (``None``: no loss scaling).
        provider: who answered (a plugin description), for the error message.

    Returns:
        ``answer``, typed as a :class:`LossScaler`.

    Raises:
        TypeError: ``answer`` lacks a callable :class:`LossScaler` method (names the provider,
            the class and the missing methods).
    """
    if answer is None:
        return None
    missing = [name for name in METHODS if not callable(getattr(answer, name, None))]
    if missing:
        raise TypeError(
            f"make_scaler answer of {provider} ({type(answer).__qualname__}) is not a "
            f"kwplug.precision.LossScaler: it lacks {', '.join(missing)} "
            f"(a LossScaler has {', '.join(METHODS)}; torch.amp.GradScaler is one)"
        )
    checked: LossScaler = answer
    return checked

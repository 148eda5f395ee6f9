"""Where one Accelerator is in a gradient accumulation: :class:`GradientState` (one per
Accelerator; ``kwplug.state.GradientState`` is Accelerate's name for a view of it)."""

from __future__ import annotations

from typing import Any

import attrs

from kwplug.data import ActiveLoaders
from kwplug.utils.dataclasses import GradientAccumulationPlugin
from kwplug.validators import is_int


def _check_steps(value: Any) -> int:
    if not is_int(value):
        raise TypeError(
            f"gradient_accumulation_steps must be an int >= 1, got {value!r} of type "
            f"{type(value).__name__}"
        )
    if value < 1:
        raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {value!r}")
    return value


@attrs.define(eq=False)
class GradientState:
    """Where one Accelerator is in a gradient accumulation (Accelerate's ``GradientState``,
    one per Accelerator instead of a process-wide singleton).

    Attributes:
        plugin_kwargs: the options given through ``GradientAccumulationPlugin`` (its
            ``to_kwargs()``: the fields that differ from the defaults, as Accelerate keeps
            them, so an option is in effect only when given).
        sync_gradients: whether the current step ends with an optimizer step (``True``
            outside ``accumulate()``).
        step: micro-batches since the last synchronising step.
        loaders: the prepared data loaders being iterated (they register themselves), whose
            last batch forces a synchronising step.
    """

    plugin_kwargs: dict[str, Any] = attrs.Factory(dict)
    sync_gradients: bool = True
    step: int = 0
    loaders: ActiveLoaders = attrs.Factory(ActiveLoaders)

    @classmethod
    def from_plugin(cls, plugin: GradientAccumulationPlugin) -> GradientState:
        """The state for ``plugin`` (``num_steps=None`` means 1)."""
        return cls(plugin_kwargs=plugin.to_kwargs())

    @property
    def num_steps(self) -> int:
        """Micro-batches per optimizer step (``gradient_accumulation_steps``)."""
        return int(self.plugin_kwargs.get("num_steps") or 1)

    @num_steps.setter
    def num_steps(self, value: int) -> None:
        self.plugin_kwargs["num_steps"] = _check_steps(value)

    @property
    def adjust_scheduler(self) -> bool:
        """Count accumulation steps in prepared schedulers' ``_step_count`` (only when
        ``adjust_scheduler=True`` was given explicitly, as in Accelerate)."""
        return bool(self.plugin_kwargs.get("adjust_scheduler", False))

    @property
    def sync_with_dataloader(self) -> bool:
        """The last batch of a prepared data loader forces a synchronising step."""
        return bool(self.plugin_kwargs.get("sync_with_dataloader", True))

    @property
    def sync_each_batch(self) -> bool:
        """Synchronise gradients on every micro-batch (the optimizer still waits)."""
        return bool(self.plugin_kwargs.get("sync_each_batch", False))

    @property
    def active_loader(self) -> Any:
        """The innermost prepared data loader being iterated, or ``None``."""
        return self.loaders.active

    @property
    def active_dataloader(self) -> Any:
        """Accelerate's name of :attr:`active_loader`: the innermost prepared data loader
        being iterated, or ``None``."""
        return self.loaders.active

    @property
    def in_dataloader(self) -> bool:
        """Whether a prepared data loader is being iterated."""
        return self.loaders.active is not None

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the active loader is handing out its last batch of the epoch (prepared
        loaders read one batch ahead to know, as Accelerate's do)."""
        return self.loaders.end_of_dataloader

    def state_dict(self) -> dict[str, Any]:
        """The position in the accumulation, for a checkpoint taken mid-accumulation
        (``{"step": int, "sync_gradients": bool}``)."""
        return {"step": self.step, "sync_gradients": self.sync_gradients}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a position from :meth:`state_dict`."""
        self.step, self.sync_gradients = int(state["step"]), bool(state["sync_gradients"])

    def restart(self) -> None:
        """Forget the micro-batches counted so far (``Accelerator.free_memory``/``clear``, as
        Accelerate's ``free_memory`` resets its step): the next accumulation starts afresh."""
        self.step = 0

    def do_sync(self) -> None:
        """Advance one micro-batch: synchronise every ``num_steps``-th one, and at the end of
        a prepared data loader (which also restarts the count)."""
        if self.sync_with_dataloader and self.end_of_dataloader:
            self.step = 0
            self.sync_gradients = True
        else:
            self.step += 1
            self.sync_gradients = self.step % self.num_steps == 0

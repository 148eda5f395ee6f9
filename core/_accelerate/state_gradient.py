"""``kwplug.state.GradientState``: Accelerate's name for the gradient-accumulation state, as a
view of the live ``Accelerator``'s.

Accelerate keeps one process-wide ``GradientState`` singleton that every ``Accelerator`` and
prepared data loader share. kwplug keeps that state per Accelerator
(``accelerator.gradient_state``); ``GradientState()`` reads the one of the live Accelerator
(the most recent one still referenced, in :mod:`kwplug._runtime`'s registry), so a script
that builds it to ask ``sync_gradients`` or ``end_of_dataloader`` gets the same answers as
under Accelerate.
Without a live Accelerator the answers are those of Accelerate's fresh singleton (no
accumulation, no loader).
"""

from __future__ import annotations

from typing import Any

from kwplug._runtime import live_accelerator

__all__ = ["GradientState"]


def _live() -> Any:
    accelerator = live_accelerator()
    return None if accelerator is None else accelerator.gradient_state


class GradientState:
    """The live Accelerator's gradient-accumulation state (Accelerate's ``GradientState``).

    Args:
        gradient_accumulation_plugin: Accelerate's way to configure the singleton. kwplug
            takes it from ``Accelerator(gradient_accumulation_plugin=...)``; only ``None`` is
            accepted here.

    Raises:
        TypeError: a ``gradient_accumulation_plugin`` was given.
    """

    def __init__(self, gradient_accumulation_plugin: Any = None) -> None:
        if gradient_accumulation_plugin is not None:
            raise TypeError(
                "GradientState(gradient_accumulation_plugin=...): kwplug keeps the gradient "
                "state per Accelerator; pass the plugin to Accelerator(gradient_accumulation_"
                "plugin=...) and read accelerator.gradient_state"
            )

    @classmethod
    def _reset_state(cls) -> None:
        """Nothing to reset: each Accelerator owns its gradient state (Accelerate clears its
        singleton here so that the next Accelerator starts afresh, which kwplug's do)."""

    def __repr__(self) -> str:
        return (
            f"GradientState(sync_gradients={self.sync_gradients}, num_steps={self.num_steps}, "
            f"end_of_dataloader={self.end_of_dataloader}, remainder={self.remainder})"
        )

    @property
    def initialized(self) -> bool:
        """Whether an Accelerator's state is described."""
        return _live() is not None

    @property
    def sync_gradients(self) -> bool:
        """Whether the current step ends with an optimizer step (``True`` by default)."""
        live = _live()
        return True if live is None else bool(live.sync_gradients)

    @property
    def num_steps(self) -> int:
        """Micro-batches per optimizer step (1 by default)."""
        live = _live()
        return 1 if live is None else int(live.num_steps)

    @property
    def adjust_scheduler(self) -> bool:
        """Whether prepared schedulers count accumulation steps."""
        live = _live()
        return False if live is None else bool(live.adjust_scheduler)

    @property
    def sync_with_dataloader(self) -> bool:
        """Whether a prepared loader's last batch forces a synchronising step."""
        live = _live()
        return True if live is None else bool(live.sync_with_dataloader)

    @property
    def sync_each_batch(self) -> bool:
        """Whether gradients are synchronised on every micro-batch."""
        live = _live()
        return False if live is None else bool(live.sync_each_batch)

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        """The options given through ``GradientAccumulationPlugin`` (a copy)."""
        live = _live()
        return {} if live is None else dict(live.plugin_kwargs)

    @property
    def active_dataloader(self) -> Any:
        """The innermost prepared data loader being iterated, or ``None``."""
        live = _live()
        return None if live is None else live.active_dataloader

    @property
    def in_dataloader(self) -> bool:
        """Whether a prepared data loader is being iterated."""
        return self.active_dataloader is not None

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the active loader is handing out its last batch of the epoch."""
        live = _live()
        return False if live is None else bool(live.end_of_dataloader)

    @property
    def remainder(self) -> int:
        """Real samples in the active loader's last global batch (``-1`` when unknown), as
        ``gather_for_metrics`` uses it."""
        loader = self.active_dataloader
        return -1 if loader is None else int(getattr(loader, "remainder", -1))

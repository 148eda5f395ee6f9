"""Accelerate's attribute names on a prepared loader that code written for Accelerate reads,
as views of kwplug's own: ``iteration`` (the epoch) and ``base_dataloader`` (the loader
itself: a kwplug loader is a ``DataLoader``, not an adapter around one)."""

from __future__ import annotations

from typing import Any


class AccelerateLoaderNames:
    """Mixed into :class:`kwplug._data._loader.PreparedDataLoader`."""

    epoch: int

    @property
    def iteration(self) -> int:
        """Accelerate's ``DataLoaderShard.iteration``: :attr:`epoch` (the epoch of the current
        or next iteration, advanced when one completes, as Accelerate's counter)."""
        return self.epoch

    @property
    def base_dataloader(self) -> Any:
        """Accelerate's ``DataLoaderAdapter.base_dataloader``: the ``DataLoader`` batches come
        from, which for a kwplug loader is the loader itself."""
        return self

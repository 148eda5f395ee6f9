"""Accelerate's attribute names on a prepared loader that code written for Accelerate reads,
as views of kwplug's own: ``iteration`` (the epoch), ``base_dataloader`` (the loader
itself: a kwplug loader is a ``DataLoader``, not an adapter around one) and
``gradient_state`` (the preparing Accelerator's)."""

from __future__ import annotations

from typing import Any, cast


class _TheLoader:
    """``base_dataloader``: the loader itself, on an instance only (Accelerate's is an
    instance attribute, so the class has none: ``DataLoaderShard.base_dataloader`` raises
    ``AttributeError``)."""

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            raise AttributeError("base_dataloader is an attribute of a loader, not of its class")
        return instance


class AccelerateLoaderNames:
    """Mixed into :class:`kwplug._data._loader.PreparedDataLoader`."""

    epoch: int

    #: Accelerate's ``DataLoaderShard.gradient_state``: the ``GradientState`` of the
    #: Accelerator that prepared the loader (``accelerator.gradient_state``, one per
    #: Accelerator; set by its ``prepare``), ``None`` for a loader no Accelerator prepared
    #: (``prepare_dataloader``, ``DataLoaderShard(...)``). Held strongly: the loader keeps it
    #: alive, as Accelerate's loaders keep theirs.
    gradient_state: Any = None

    @property
    def iteration(self) -> int:
        """Accelerate's ``DataLoaderShard.iteration``: :attr:`epoch` (the epoch of the current
        or next iteration, advanced when one completes, as Accelerate's counter)."""
        return self.epoch

    @property
    def _drop_last(self) -> bool:
        """Accelerate's ``DataLoaderShard._drop_last``/``DataLoaderDispatcher._drop_last``:
        the last batch counts as dropped (``remainder`` is ``-1``; a dispatched loader does not
        complete its last global batch) -- the user's ``drop_last``, as Accelerate's
        ``prepare`` passes it."""
        return bool(cast(Any, self).sharding.drop_last)  # PreparedDataLoader's Sharding

    @property
    def _non_blocking(self) -> bool:
        """Accelerate's ``_non_blocking``: host-to-device copies are asynchronous
        (``DataLoaderConfiguration(non_blocking=True)``)."""
        return bool(cast(Any, self).sharding.non_blocking)

    #: Accelerate's ``DataLoaderAdapter.base_dataloader``: the ``DataLoader`` batches come
    #: from, which for a kwplug loader is the loader itself.
    base_dataloader = _TheLoader()

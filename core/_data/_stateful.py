"""Prepared data loaders backed by torchdata's ``StatefulDataLoader``
(``DataLoaderConfiguration(use_stateful_dataloader=True)``, as Accelerate's).

The loader *is* a ``torchdata.stateful_dataloader.StatefulDataLoader`` (``isinstance`` holds,
as under Accelerate) and a :class:`~kwplug.data.PreparedDataLoader`: its batches are the
same. Its position (:meth:`state_dict`) is torchdata's state of the underlying iterator,
taken when the batch last handed out was produced (the loader reads one batch ahead: that
read is not counted, as in Accelerate's ``DataLoaderShard``), with kwplug's keys beside it
(``epoch``, ``batches_yielded``, the epoch's order, ``skipped``). Resuming restores the
order from kwplug's keys and lets torchdata put the iterator back: a data set or sampler with
``state_dict``/``load_state_dict`` is restored from its state (a stream is not read again),
anything else is fast-forwarded by torchdata.

This module imports torchdata; :mod:`kwplug._data._prepare` imports it only for that flag.
"""

from __future__ import annotations

import warnings
from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from kwplug._data._dispatch import DispatchedDataLoader
from kwplug._data._loader import PreparedDataLoader, SkippableBatches

__all__ = ["StatefulDispatchedDataLoader", "StatefulPreparedDataLoader", "is_stateful_position"]

#: kwplug's keys in a stateful position; every other key is torchdata's.
_KEPT = ("skipped", "first_samples", "rng_after_iterator")  # only a stateful loader's
_OWN = frozenset(("epoch", "batches_yielded", "generator", "global_rng", "offset", *_KEPT))


def _torchdata_part(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k not in _OWN}


def is_stateful_position(state: Any) -> bool:
    """``state`` holds torchdata's keys (a stateful loader's position)."""
    return isinstance(state, dict) and bool(_torchdata_part(state))


class _TorchdataPosition:
    """The position of a prepared loader whose iterator is torchdata's (mixed in before
    :class:`~kwplug.data.PreparedDataLoader`, with ``StatefulDataLoader`` after it)."""

    # What PreparedDataLoader (after this class in the MRO) provides.
    epoch: int
    batches_yielded: int
    end_of_dataloader: bool
    batch_sampler: Any
    next_iter_state: dict[str, Any] | None
    _restore: dict[str, Any] | None
    _resumed: int
    _initial_iter_for_state_dict: bool
    _epoch_start: dict[str, Any]
    num_workers: int
    _skipped: int
    _skip: int
    _epoch_sent: bool
    _resume_first: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with warnings.catch_warnings():
            # torchdata 0.11 calls torch.set_vital, deprecated in recent torch: noise that
            # says nothing about the user's code, once per prepared loader.
            warnings.filterwarnings("ignore", "'set_vital' is deprecated", UserWarning)
            super().__init__(*args, **kwargs)
        self._snapshot_state: dict[str, Any] | None = None  # the batch held: its position
        self._loaded: dict[str, Any] | None = None  # restored, not iterated yet
        # As Accelerate's DataLoaderAdapter: torchdata's state_dict() now, which builds the
        # first epoch's iterator (drawing its base seed from torch's generator here, so that
        # the draws after prepare are Accelerate's); the first iteration uses it.
        # Workers take their indices when the iterator is built: that epoch's order comes
        # from the generators as they are now.
        self._built_from = self._snapshot(self.sharding.global_rng)  # type: ignore[attr-defined]
        StatefulDataLoader.state_dict(self)
        self._early = True  # this epoch's iterator was built before it started

    def __getstate__(self) -> dict[str, Any]:
        # torchdata's live iterator does not pickle (nor mean anything elsewhere); the
        # position does. The copy's next iteration builds a new one.
        state = dict(self.__dict__)
        state["_iterator"], state["_initial_iter_for_state_dict"] = None, False
        return state

    @property
    def use_stateful_dataloader(self) -> bool:
        """Always ``True`` (Accelerate's attribute of its adapters)."""
        return True

    def _position_reached(self) -> None:
        self._snapshot_state = StatefulDataLoader.state_dict(self)

    def _start_iterator(self) -> Any:
        self._snapshot_state = None
        self._early = bool(self._initial_iter_for_state_dict)
        iterator = super()._start_iterator()  # type: ignore[misc]
        if self._early and self.num_workers > 0:
            self._epoch_start.update(self._built_from)
        return iterator

    @property
    def _replay_after_iterator(self) -> bool:
        # In the main process the sampler draws at the first batch, after the iterator (built
        # early) drew its seed; workers' indices were drawn when it was built.
        return self._early and self.num_workers == 0

    def _forget_restored(self) -> None:
        self.next_iter_state, self._loaded, self._resumed = None, None, 0
        self._resume_first = None

    def set_epoch(self, epoch: int) -> None:
        """As :meth:`kwplug.data.PreparedDataLoader.set_epoch`, except that a restored
        position of that same epoch is kept (as Accelerate's stateful loaders, whose
        ``set_epoch`` only reaches the samplers)."""
        if self._loaded is not None and epoch == self.epoch:
            self._set_epoch_everywhere(epoch)  # type: ignore[attr-defined]
            self._epoch_sent = True
            return
        self._forget_restored()
        super().set_epoch(epoch)  # type: ignore[misc]

    def skip_first_batches(self, num_batches: int) -> None:
        """As :meth:`kwplug.data.PreparedDataLoader.skip_first_batches`; it replaces a
        restored position, torchdata's included. The loader stays stateful (Accelerate's
        function returns a copy that is not)."""
        super().skip_first_batches(num_batches)  # type: ignore[misc]
        self._forget_restored()

    def state_dict(self) -> dict[str, Any]:
        """torchdata's ``StatefulDataLoader.state_dict()`` as of the batch last handed out
        (``_iterator_finished`` true at the epoch's last batch, as Accelerate's), with
        kwplug's keys: ``epoch``, ``batches_yielded``, ``generator``, ``global_rng``,
        ``offset`` (as the loader's without the flag) and ``skipped`` (batches that
        ``skip_first_batches`` dropped before torchdata's iterator saw them). Before the first
        batch of an epoch and after its last, only kwplug's keys (the epoch from its start)."""
        state: dict[str, Any] = super().state_dict()  # type: ignore[misc]
        if self._restore is not None and self._loaded is not None:
            return {**state, **self._loaded}
        if self._restore is None and self.batches_yielded and self._snapshot_state is not None:
            torchdata = dict(self._snapshot_state)
            if self.end_of_dataloader:
                torchdata["_iterator_finished"] = True
            state["skipped"] = self._skipped
            state["rng_after_iterator"] = self._replay_after_iterator
            first = getattr(self, "_first", None)  # a dispatched loader's
            if first is not None:
                state["first_samples"] = first
            return {**state, **torchdata}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a position from :meth:`state_dict` (a plain ``StatefulDataLoader``
        state dict loads too, in the current epoch): the next iteration replays that epoch's
        order and torchdata resumes its iterator after the batch last handed out. A position
        at an epoch's last batch resumes at the next epoch's start, as torchdata's. One with
        only kwplug's keys resumes as a loader without the flag."""
        torchdata = _torchdata_part(state)
        self._forget_restored()
        full = {"epoch": self.epoch, "batches_yielded": 0, **state}
        super().load_state_dict(full)  # type: ignore[misc]
        if not torchdata:
            return
        if torchdata.get("_iterator_finished"):
            self.set_epoch(int(full["epoch"]) + 1)
            StatefulDataLoader.load_state_dict(self, torchdata)
            return
        skipped = int(full.get("skipped") or 0)
        if not isinstance(self.batch_sampler, SkippableBatches):
            skipped = 0  # an iterable data set's skipped batches were read: torchdata counts them
        self._skip, self._resumed = skipped, self.batches_yielded - skipped
        assert self._restore is not None
        self._restore["rng_after_iterator"] = bool(full.get("rng_after_iterator"))
        self._resume_first = full.get("first_samples")
        StatefulDataLoader.load_state_dict(self, torchdata)
        kept = {k: full[k] for k in _KEPT if k in full}
        self._loaded = {**kept, **torchdata}


class StatefulPreparedDataLoader(
    _TorchdataPosition,
    PreparedDataLoader,
    StatefulDataLoader,  # type: ignore[misc]  # torchdata has no type hints
):
    """A :class:`~kwplug.data.PreparedDataLoader` that is torchdata's ``StatefulDataLoader``
    (``use_stateful_dataloader=True``); see :mod:`kwplug._data._stateful`."""


class StatefulDispatchedDataLoader(
    _TorchdataPosition,
    DispatchedDataLoader,
    StatefulDataLoader,  # type: ignore[misc]  # torchdata has no type hints
):
    """A :class:`~kwplug.data.DispatchedDataLoader` that is torchdata's ``StatefulDataLoader``
    (``use_stateful_dataloader=True`` with ``dispatch_batches``). Process 0 reads: its
    position is what resumes the stream; the others' only carry kwplug's keys' meaning."""

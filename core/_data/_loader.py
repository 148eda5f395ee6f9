"""The prepared data loader: Accelerate's per-rank batches, device placement, and a position
that a checkpoint can save and restore."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
import torch
from torch.utils.data import DataLoader

from kwplug._data._names import AccelerateLoaderNames
from kwplug._data._shards import BatchSamplerShard
from kwplug.utils.structures import send_to_device


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested) tuple, list or mapping to ``device``."""
    return send_to_device(batch, device, non_blocking=non_blocking)


@attrs.define(eq=False)
class ActiveLoaders:
    """The prepared loaders being iterated, innermost last: what ``gather_for_metrics`` and
    gradient accumulation ask about "the current data loader".

    Attributes:
        stack: the loaders whose iteration has started and not finished.
    """

    stack: list[PreparedDataLoader] = attrs.Factory(list)

    @property
    def active(self) -> PreparedDataLoader | None:
        """The innermost loader being iterated, or ``None``."""
        return self.stack[-1] if self.stack else None

    @property
    def end_of_dataloader(self) -> bool:
        """True while the active loader's last batch of the epoch is being processed."""
        return self.active is not None and self.active.end_of_dataloader

    @property
    def remainder(self) -> int:
        """Samples of the active loader's last global batch that are real (not repeated from
        the start to even it out); ``-1`` when unknown or when no loader is active."""
        return self.active.remainder if self.active is not None else -1

    def begin(self, loader: PreparedDataLoader) -> None:
        """``loader`` started an iteration."""
        self.stack.append(loader)

    def end(self, loader: PreparedDataLoader) -> None:
        """``loader`` finished (or abandoned) its iteration."""
        if loader in self.stack:
            self.stack.remove(loader)


class SkippableBatches:
    """A batch sampler that drops the first ``skip`` batches of ``batches`` once, without
    loading their samples (the next iteration yields everything again)."""

    def __init__(self, batches: Iterable[list[int]]) -> None:
        self.batches = batches
        self.skip = 0

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip = self.skip, 0
        for index, batch in enumerate(self.batches):
            if index >= skip:
                yield batch

    def __getattr__(self, name: str) -> Any:  # batch_size, drop_last, sampler...
        # Not the state methods: torchdata's StatefulDataLoader would take the user's sampler
        # state for this wrapper's (it fast-forwards by index instead).
        if name in ("batches", "state_dict", "load_state_dict"):
            raise AttributeError(name)
        return getattr(self.batches, name)


@attrs.frozen
class Sharding:
    """How a prepared loader was sharded (see :func:`kwplug.data.prepare_dataloader`).

    Attributes:
        num_processes: processes sharing the data; process_index: this process's rank.
        split_batches: each global batch is sliced across processes.
        total_batch_size: samples per global batch (``None`` when batches vary in size).
        dataset_length: samples in the data set (``None`` when unsized).
        drop_last: the short last batch is dropped.
        non_blocking: host-to-device copies are asynchronous.
        sync_generator: the sampler's generator, made equal on every process at each epoch
            start (rank 0's state is broadcast).
        global_rng: the sampler draws from torch's global generator: its state at each epoch
            start is kept so that a resumed epoch replays the same order.
    """

    num_processes: int = 1
    process_index: int = 0
    split_batches: bool = False
    total_batch_size: int | None = None
    dataset_length: int | None = None
    drop_last: bool = False
    non_blocking: bool = False
    sync_generator: torch.Generator | None = None
    global_rng: bool = False


class PreparedDataLoader(AccelerateLoaderNames, DataLoader[Any]):
    """A ``DataLoader`` that yields this process's batches, on its device.

    Built by :func:`kwplug.data.prepare_dataloader`. Each complete iteration is one epoch;
    before it starts, ``set_epoch(epoch)`` is passed to the samplers and the data set that
    have it. The loader looks one batch ahead, so that :attr:`end_of_dataloader` is already
    true while the last batch is processed (gradient accumulation syncs there, and
    ``gather_for_metrics`` drops the samples repeated to even out the last global batch).

    Attributes:
        device: where batches are moved (``None``: left where the collate function put them).
        device_placement: ``False`` (``prepare(..., device_placement=[False])``): batches are
            left where the collate function put them (``device`` still serves collectives).
        epoch: the epoch of the current (or next) iteration; it advances when an iteration
            completes (an iteration left early is restarted at the same epoch).
        batches_yielded: batches of the current epoch handed out so far, skipped ones included.
        end_of_dataloader: the batch just yielded is the epoch's last.
        remainder: samples of the last global batch that are real (``-1`` unknown).
        sharding: how the data was sharded (:class:`Sharding`).
        tracker: the Accelerator's :class:`ActiveLoaders`, told when iterations begin/end.
        on_end: callables called with the loader when an iteration completes.
    """

    def __init__(
        self,
        *args: Any,
        device: torch.device | None,
        sharding: Sharding | None = None,
        batch_size_per_process: int | None = None,
        tracker: ActiveLoaders | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        # DataLoader forbids setting batch_size once built with a batch sampler; it is only
        # informative here (the per-process batch size), so bypass its check.
        object.__setattr__(self, "batch_size", batch_size_per_process)
        self.device = device
        self.device_placement = True
        self.sharding = sharding or Sharding()
        self.tracker = tracker
        self.on_end: list[Callable[[PreparedDataLoader], None]] = []
        self.epoch = 0
        self.batches_yielded = 0
        self.end_of_dataloader = False
        self._skip = 0
        self._restore: dict[str, Any] | None = None
        self._epoch_start: dict[str, Any] = {}
        self._epoch_sent = False
        # A stateful loader's restored position (kwplug._data._stateful): batches the
        # underlying iterator resumes after, and the batches its batch sampler skipped.
        self._resumed = 0
        self._skipped = 0

    @property
    def total_batch_size(self) -> int | None:
        """Samples in one global batch, over all processes."""
        return self.sharding.total_batch_size

    @property
    def total_dataset_length(self) -> int | None:
        """Samples in the data set (all processes together)."""
        return self.sharding.dataset_length

    @property
    def remainder(self) -> int:
        """Real samples in the last global batch: ``len(dataset) % total_batch_size`` (so 0
        when it divides), ``-1`` when the last batch is dropped or the sizes are unknown."""
        size, length = self.sharding.total_batch_size, self.sharding.dataset_length
        if self.sharding.drop_last or not size or length is None:
            return -1
        return length % size

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration, from its start; passed at once, as by
        Accelerate's ``DataLoaderShard``, to the batch sampler, the samplers and the data set
        that have a ``set_epoch`` (a custom batch sampler's included)."""
        self.epoch, self.batches_yielded, self._skip, self._restore = epoch, 0, 0, None
        self._set_epoch_everywhere(epoch)
        self._epoch_sent = True  # the next iteration need not pass it again

    def skip_first_batches(self, num_batches: int) -> None:
        """Start the next iteration at batch ``num_batches``, as Accelerate's resume idiom.

        The next iteration draws its order as any new iteration does (as Accelerate's does)
        and skips ``num_batches`` batches. It replaces a position restored by
        :meth:`load_state_dict` (the count is not added to it, and that epoch's saved order is
        not replayed).
        """
        if num_batches < 0:
            raise ValueError(f"num_batches must be >= 0, got {num_batches}")
        self._skip, self._restore = num_batches, None

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch comes from: ``epoch``, ``batches_yielded``, ``offset`` (batches
        of the user's batch sampler skipped before this epoch's batches were dealt to the
        processes: non-zero only in an epoch resumed on another number of processes), and
        what fixes the epoch's order: ``generator`` (the sampler's generator at the epoch
        start) and ``global_rng`` (torch's CPU generator at the epoch start, when the sampler
        draws from it); each ``None`` when not needed."""
        if self._restore is not None:  # restored, not iterated yet
            start = self._restore
        elif self.batches_yielded:
            start = self._epoch_start
        else:
            start = self._snapshot(global_rng=False)
        return {
            "epoch": self.epoch,
            "batches_yielded": self.batches_yielded,
            "generator": start.get("generator"),
            "global_rng": start.get("global_rng"),
            "offset": int(start.get("offset") or 0),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a position from :meth:`state_dict`: the next iteration replays that
        epoch's order and skips the batches already handed out."""
        self.set_epoch(int(state["epoch"]))
        self._skip = self.batches_yielded = int(state["batches_yielded"])
        self._restore = {k: state.get(k) for k in ("generator", "global_rng", "offset")}
        self._restore["batches"] = self.batches_yielded

    def _snapshot(self, global_rng: bool) -> dict[str, Any]:
        sync = self.sharding.sync_generator
        return {
            "generator": sync.get_state() if sync is not None else None,
            "global_rng": torch.get_rng_state() if global_rng else None,
        }

    def _set_epoch_everywhere(self, epoch: int) -> None:
        # As Accelerate: the user's batch sampler, its sampler (DistributedSampler,
        # SeedableRandomSampler) and the data set, under kwplug's own wrappers.
        batches = _user_batches(self.batch_sampler)
        targets: list[Any] = [batches, getattr(batches, "sampler", None), self.dataset]
        for index, target in enumerate(targets):
            if any(target is earlier for earlier in targets[:index]):
                continue
            if target is not None and callable(getattr(target, "set_epoch", None)):
                target.set_epoch(epoch)

    def _sync_generator(self) -> None:
        generator = self.sharding.sync_generator
        if generator is None or self.sharding.num_processes == 1:
            return
        from kwplug.utils.operations import broadcast

        state = generator.get_state()
        on_device = state.to(self.device) if self.device is not None else state
        generator.set_state(broadcast(on_device).cpu())

    def _start_iterator(self) -> Iterator[Any]:
        restore, self._restore = self._restore, None
        sync = self.sharding.sync_generator
        if restore is None:
            self._sync_generator()
        elif restore.get("generator") is not None and sync is not None:
            sync.set_state(restore["generator"])
        self._epoch_start = self._snapshot(self.sharding.global_rng)
        if not restore:
            return super().__iter__()
        offset = self._epoch_start["offset"] = int(restore.get("offset") or 0)
        if offset:
            _skip_dealt(self.batch_sampler, offset)
        # Saved by a run of another size, whose sampler drew its order from another source
        # (see kwplug.checkpoint._resize): replay that source for this epoch only.
        sampler = _index_sampler(self.batch_sampler)
        order: Any = _KEEP
        if sampler is not None and hasattr(sampler, "generator"):
            if restore.get("generator") is not None and sync is None:
                order = torch.Generator().set_state(restore["generator"])
                self._epoch_start["generator"] = restore["generator"]
            elif restore.get("global_rng") is not None and not self.sharding.global_rng:
                order = None  # the sampler draws from the replayed global generator
                self._epoch_start["generator"] = None
        if not restore.get("batches") and order is _KEEP and restore.get("global_rng") is None:
            return super().__iter__()
        # Resuming an epoch saved mid-way: the interrupted run drew from the global generator
        # when it started (worker seed, sampler), before the checkpoint; replay those draws
        # from the epoch's saved start, or skip them, and leave the global state untouched.
        current, own = torch.get_rng_state(), getattr(sampler, "generator", None)
        replay = restore.get("global_rng")
        # A stateful loader's first iterator was built when it was prepared (as
        # Accelerate's): that epoch's draws at its start came after the iterator's.
        late = bool(restore.get("rng_after_iterator"))
        if replay is not None:
            self._epoch_start["global_rng"] = replay
            if not late:
                torch.set_rng_state(replay)
        if order is not _KEEP:
            sampler.generator = order
        try:
            iterator = super().__iter__()
            if replay is not None and late:
                torch.set_rng_state(replay)
            draws = replay is not None or order is not _KEEP
            first = next(iterator, _END) if draws else _END
        finally:
            torch.set_rng_state(current)
            if order is not _KEEP:
                sampler.generator = own
        return iterator if first is _END else _chain(first, iterator)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        skip, self._skip = self._skip, 0
        if not self._epoch_sent:  # each epoch reaches the samplers once
            self._set_epoch_everywhere(self.epoch)
        self._epoch_sent = False
        if isinstance(self.batch_sampler, SkippableBatches):
            self.batch_sampler.skip, dropped = skip, 0
        else:  # an iterable data set: the skipped batches are read and dropped
            dropped = skip
        self.end_of_dataloader = False
        self._skipped = skip - dropped
        resumed, self._resumed = self._resumed, 0
        self.batches_yielded = skip + resumed
        iterator = self._start_iterator()
        if self.tracker is not None:
            self.tracker.begin(self)
        try:
            yield from self._rank_batches(iterator, dropped)
        finally:
            if self.tracker is not None:
                self.tracker.end(self)
        # The next epoch reaches the samplers when it starts (or at the user's set_epoch).
        self.epoch, self.batches_yielded, self._restore = self.epoch + 1, 0, None
        for callback in self.on_end:
            callback(self)

    def _position_reached(self) -> None:
        """The underlying iterator has produced the batch about to be yielded (and nothing
        after it): where a stateful loader takes its snapshot (no-op here)."""

    def _rank_batches(self, iterator: Iterator[Any], skip: int) -> Iterator[Any]:
        """This process's batches from the underlying ``DataLoader`` iterator, after dropping
        ``skip`` of them (read, not yielded: an iterable data set cannot skip unread)."""
        for _ in range(skip):
            next(iterator, None)
        return self._look_ahead(iterator)

    def _look_ahead(self, iterator: Iterator[Any]) -> Iterator[Any]:
        current = next(iterator, _END)
        while current is not _END:
            self._position_reached()
            if self.device is not None and self.device_placement:
                current = to_device(current, self.device, self.sharding.non_blocking)
            following = next(iterator, _END)
            self.end_of_dataloader = following is _END
            self.batches_yielded += 1
            yield current
            current = following


_END: Any = object()
_KEEP: Any = object()


def _user_batches(batch_sampler: Any) -> Any:
    """The user's batch sampler under kwplug's wrappers (``SkippableBatches``, shards)."""
    while isinstance(batch_sampler, (SkippableBatches, BatchSamplerShard)):
        if isinstance(batch_sampler, SkippableBatches):
            batch_sampler = batch_sampler.batches
        else:
            batch_sampler = batch_sampler.batch_sampler
    return batch_sampler


def _index_sampler(batch_sampler: Any) -> Any:
    """The user's index sampler under a prepared loader's batch sampler, or ``None``."""
    holder = getattr(batch_sampler, "batches", None)
    if isinstance(holder, BatchSamplerShard):
        holder = holder.batch_sampler
    if isinstance(holder, SkippableBatches):
        holder = holder.batches
    return getattr(holder, "sampler", None)


def _skip_dealt(batch_sampler: Any, offset: int) -> None:
    """Skip ``offset`` batches of the user's batch sampler, once, before they are dealt."""
    shard = getattr(batch_sampler, "batches", None)
    if not isinstance(shard, BatchSamplerShard):
        raise ValueError("a batch offset needs a loader sharded across several processes")
    if not isinstance(shard.batch_sampler, SkippableBatches):
        shard.batch_sampler = SkippableBatches(shard.batch_sampler)
    shard.batch_sampler.skip = offset


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest

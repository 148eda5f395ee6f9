"""``prepare_dataloader``: rebuild a user's ``DataLoader`` so that it yields this process's
batches, as ``accelerate.data_loader.prepare_data_loader`` does."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from kwplug._data._dispatch import DispatchedDataLoader
from kwplug._data._loader import ActiveLoaders, PreparedDataLoader, Sharding, SkippableBatches
from kwplug._data._shards import (
    BatchSamplerShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    check_split,
    sampler_of,
)
from kwplug.errors import KwplugWarning
from kwplug.utils.dataclasses import DataLoaderConfiguration

#: DataLoader arguments copied from the user's loader (the sampling ones are rebuilt).
_COPIED = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def _draw_seed() -> int:
    # The draw Accelerate makes from torch's global generator (the same stream after set_seed).
    return int(torch.empty((), dtype=torch.int64).random_().item())


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


def prepare_dataloader(
    loader: DataLoader[Any],
    device: torch.device,
    world_size: int,
    rank: int,
    seed: int | None = None,
    config: DataLoaderConfiguration | None = None,
    tracker: ActiveLoaders | None = None,
) -> PreparedDataLoader:
    """Rebuild ``loader`` so that each rank reads its own part, as Accelerate does.

    - Map-style data set, several processes: the loader's batch sampler is wrapped in a
      :class:`~kwplug.data.BatchSamplerShard`: rank ``r`` gets batches ``r, r + n, ...``
      (``split_batches``: slice ``r`` of every batch) and, unless ``drop_last``, the last
      round is completed from the start of the epoch (``even_batches``). Custom samplers and
      batch samplers are sharded the same way; a sampler that shuffles with a ``generator``
      gets one (seeded from torch's global generator, or ``seed``) whose state is broadcast
      from rank 0 at every epoch start, so every rank draws the same order. A user's
      ``DistributedSampler`` already shards: it is kept and not sharded again.
    - ``dispatch_batches`` (``None``, the default: an iterable data set): a
      :class:`~kwplug.data.DispatchedDataLoader`; process 0 reads the user's loader (its
      whole batch sampler, or the stream) and every process receives its slice of each
      global batch, as Accelerate's ``DataLoaderDispatcher``.
    - Iterable data set with ``dispatch_batches=False``, several processes: wrapped in a
      :class:`~kwplug.data.IterableDatasetShard`.
    - One process: the batches are the user loader's own.
    - ``use_seedable_sampler``: a ``RandomSampler`` becomes a
      :class:`~kwplug.data.SeedableRandomSampler` (seed ``data_seed``, else
      ``torch.initial_seed()`` of process 0, broadcast to the others; the order depends on
      the seed and epoch only, so the shards partition the data).

    Args:
        loader: the user's data loader (a :class:`PreparedDataLoader` is returned as is).
        device: where batches go (the CPU: left in place).
        world_size: number of processes; rank: this process's global rank.
        seed: kwplug's own option: seed the shuffling generator with it instead of a draw from
            torch's global generator (``None``, default: Accelerate's behaviour).
        config: the Accelerator's :class:`~kwplug.utils.DataLoaderConfiguration`.
        tracker: told when an iteration begins and ends (``gather_for_metrics``, gradient
            accumulation).

    Returns:
        A :class:`PreparedDataLoader` yielding this rank's batches.

    Raises:
        ValueError: ``split_batches`` with a batch size that is unknown or not a multiple of
            ``world_size``; a ``DistributedSampler`` built for another number of processes,
            or with ``dispatch_batches=True``; an iterable data set without a batch size in
            several processes (unless dispatched).

    Warns:
        KwplugWarning: ``even_batches=False`` with a dispatched loader in several processes
            (it has no effect, as in Accelerate); a seedable sampler whose seed on this
            process differed from process 0's.
    """
    if isinstance(loader, PreparedDataLoader):
        return loader
    config = config or DataLoaderConfiguration()
    n, split = world_size, config.split_batches
    kwargs = {k: getattr(loader, k) for k in _COPIED if hasattr(loader, k)}
    if loader.num_workers == 0:
        kwargs.pop("prefetch_factor", None)
    dataset, length = loader.dataset, _length(loader.dataset)
    place = None if device.type == "cpu" else device
    common: dict[str, Any] = {"device": place, "tracker": tracker, **kwargs}
    shard_cls, dispatch_cls = _loader_classes(config)

    dispatch = config.dispatch_batches
    if dispatch is None:  # Accelerate's default: dispatch iterable data sets
        dispatch = isinstance(dataset, IterableDataset)
    if dispatch:
        common.pop("generator", None)  # as Accelerate: the base seed comes from torch's RNG
        if not config.even_batches and n > 1:
            warnings.warn(
                "even_batches=False has no effect on a loader prepared with dispatch_batches "
                "(as in Accelerate): its last global batch is completed with the epoch's first "
                "samples; use dispatch_batches=False for uneven batches",
                KwplugWarning,
                stacklevel=3,
            )

    if isinstance(dataset, IterableDataset):
        batch_size = loader.batch_size
        if dispatch:
            if split:
                check_split(batch_size, n, "data loader")
            total = batch_size if (split or batch_size is None) else batch_size * n
            # batch_size stays the loader's (Accelerate's attribute; len() derives from it).
            return dispatch_cls(
                dataset,
                batch_size=batch_size,
                drop_last=loader.drop_last,
                sharding=Sharding(
                    n, rank, split, total, length, loader.drop_last, config.non_blocking
                ),
                batch_size_per_process=batch_size,
                **common,
            )
        if n > 1 and batch_size is None:
            raise ValueError(
                "an IterableDataset loader with batch_size=None cannot be sharded across "
                f"{n} processes (every rank would read the whole data set); give it a batch_size"
            )
        if n > 1 and batch_size is not None:
            dataset = IterableDatasetShard(
                dataset, batch_size, loader.drop_last, n, rank, split_batches=split
            )
        per_process = batch_size // n if (n > 1 and split and batch_size) else batch_size
        total = batch_size if (split or batch_size is None) else batch_size * n
        sharding = Sharding(n, rank, split, total, length, loader.drop_last, config.non_blocking)
        return shard_cls(
            dataset,
            batch_size=per_process,
            drop_last=loader.drop_last,
            sharding=sharding,
            batch_size_per_process=per_process,
            **common,
        )

    batches: Any = (
        loader.sampler if isinstance(loader.sampler, BatchSampler) else loader.batch_sampler
    )
    if batches is None:
        raise ValueError("a map-style DataLoader with batch_size=None cannot be prepared")
    batch_size = getattr(batches, "batch_size", None)
    sampler = sampler_of(loader)
    if config.use_seedable_sampler and type(sampler) is RandomSampler:
        sampler = SeedableRandomSampler(
            sampler.data_source,
            sampler.replacement,
            sampler._num_samples,
            sampler.generator,
            data_seed=config.data_seed,
        )
        batches = _with_sampler(batches, sampler)
        if n > 1 and config.data_seed is None and not dispatch:
            _agree_on_seed(sampler)
    sync: torch.Generator | None = None
    drop_last = bool(getattr(batches, "drop_last", loader.drop_last))
    if dispatch:
        if isinstance(sampler, DistributedSampler):
            raise ValueError(
                "dispatch_batches=True reads the loader on process 0 only, but its "
                "DistributedSampler yields only process 0's shard; drop the DistributedSampler "
                "(prepare shards the data) or use dispatch_batches=False"
            )
        if split:
            check_split(batch_size, n, "batch sampler")
        if seed is not None and isinstance(sampler, RandomSampler):
            _shared_generator(sampler, seed)
        total = None if batch_size is None else (batch_size if split else batch_size * n)
        global_rng = not isinstance(sampler, (SequentialSampler, SeedableRandomSampler))
        sharding = Sharding(
            n, rank, split, total, length, drop_last, config.non_blocking, None, global_rng
        )
        return dispatch_cls(
            dataset,
            batch_sampler=batches,
            sharding=sharding,
            batch_size_per_process=batch_size // n if (split and batch_size) else batch_size,
            **common,
        )
    if isinstance(sampler, DistributedSampler):
        if sampler.num_replicas != n:
            raise ValueError(
                f"the loader's DistributedSampler shards for {sampler.num_replicas} processes, "
                f"but {n} are running; drop it (prepare shards the data) or fix num_replicas"
            )
        total, split = None, False  # sharded by the user: sizes not ours to complete
    else:
        seedable = isinstance(sampler, SeedableRandomSampler)
        if not seedable and (n > 1 or (seed is not None and isinstance(sampler, RandomSampler))):
            sync = _shared_generator(sampler, seed)
        if n > 1:
            batches = BatchSamplerShard(batches, n, rank, split, config.even_batches)
        total = None if batch_size is None else (batch_size if split else batch_size * n)
    global_rng = sync is None and not isinstance(
        sampler, (SequentialSampler, SeedableRandomSampler, DistributedSampler)
    )
    sharding = Sharding(
        n, rank, split, total, length, drop_last, config.non_blocking, sync, global_rng
    )
    per_process = batch_size // n if (split and batch_size is not None and n > 1) else batch_size
    return shard_cls(
        dataset,
        batch_sampler=SkippableBatches(batches),
        sharding=sharding,
        batch_size_per_process=per_process,
        **common,
    )


def _loader_classes(
    config: DataLoaderConfiguration,
) -> tuple[type[PreparedDataLoader], type[DispatchedDataLoader]]:
    """The loader classes for ``config``: torchdata's ``StatefulDataLoader`` ones with
    ``use_stateful_dataloader`` (torchdata is imported only then)."""
    if not config.use_stateful_dataloader:
        return PreparedDataLoader, DispatchedDataLoader
    # DataLoaderConfiguration checked that torchdata is installed.
    from kwplug._data._stateful import StatefulDispatchedDataLoader, StatefulPreparedDataLoader

    return StatefulPreparedDataLoader, StatefulDispatchedDataLoader


def _with_sampler(batches: Any, sampler: Any) -> Any:
    """``batches`` drawing its indices from ``sampler``: a new ``BatchSampler`` when it is
    torch's own, else the user's batch sampler with its ``sampler`` replaced (as Accelerate)."""
    if type(batches) is BatchSampler:
        return BatchSampler(sampler, batches.batch_size, batches.drop_last)
    batches.sampler = sampler
    return batches


def _shared_generator(sampler: Any, seed: int | None) -> torch.Generator | None:
    """The generator the sampler shuffles with, created (and seeded as Accelerate does, or
    from ``seed``) when it has none; ``None`` for a sampler without a ``generator``."""
    if not hasattr(sampler, "generator"):
        return None
    if sampler.generator is None or seed is not None:
        sampler.generator = torch.Generator()
        sampler.generator.manual_seed(_draw_seed() if seed is None else seed)
    generator: torch.Generator = sampler.generator
    return generator


def _agree_on_seed(sampler: SeedableRandomSampler) -> None:
    """Give ``sampler`` process 0's seed, so that every process draws the same order and the
    shards partition the data even when the processes were seeded differently
    (``set_seed(..., device_specific=True)``; Accelerate shuffles each with its own seed)."""
    from kwplug.utils.operations import broadcast_object_list

    own = sampler.initial_seed
    (sampler.initial_seed,) = broadcast_object_list([own], from_process=0)
    if sampler.initial_seed != own:
        warnings.warn(
            f"use_seedable_sampler: this process's seed (torch.initial_seed() = {own}) differs "
            f"from process 0's ({sampler.initial_seed}); every process shuffles with process "
            "0's so that each sample is seen once per epoch (Accelerate would shuffle each "
            "process with its own seed, repeating some samples and missing others). Set "
            "DataLoaderConfiguration(data_seed=...) to choose the seed",
            KwplugWarning,
            stacklevel=4,
        )

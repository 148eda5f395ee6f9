"""Sharding data loaders per rank and moving batches to the device."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) tuple, list or mapping to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class PreparedDataLoader(DataLoader[Any]):
    """A ``DataLoader`` that shards with ``DistributedSampler`` and yields batches on a device.

    Each new iteration advances the sampler's epoch (``DistributedSampler.set_epoch``), so
    shuffling differs per epoch but agrees across ranks, as with a hand-written
    ``sampler.set_epoch(epoch)`` loop.
    """

    def __init__(self, *args: Any, device: torch.device, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device = device
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch used by the next iteration (for resuming)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        cpu = self.device.type == "cpu"
        for batch in super().__iter__():
            yield batch if cpu else to_device(batch, self.device)


def prepare_dataloader(
    loader: DataLoader[Any], device: torch.device, world_size: int, rank: int, seed: int = 0
) -> DataLoader[Any]:
    """Rebuild ``loader`` so that each rank reads its own shard.

    With ``world_size > 1`` the sampler becomes ``DistributedSampler(dataset, world_size, rank,
    shuffle=<loader shuffled>, seed=seed, drop_last=loader.drop_last)``: every rank gets
    ``ceil(len(dataset) / world_size)`` samples (padded by repeating, torch's semantics).
    A loader with a custom sampler or batch sampler is kept as it is, since its order is the
    user's. Iterable-style datasets are not resharded.

    Returns:
        A :class:`PreparedDataLoader`, or ``loader`` unchanged when nothing needs doing.
    """
    custom_sampler = not isinstance(
        loader.sampler, (RandomSampler, torch.utils.data.SequentialSampler)
    )
    iterable = isinstance(loader.dataset, torch.utils.data.IterableDataset)
    if device.type == "cpu" and (world_size == 1 or custom_sampler or iterable):
        return loader
    sampler: Any = loader.sampler
    if world_size > 1 and not custom_sampler and not iterable:
        sampler = DistributedSampler(
            loader.dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=isinstance(loader.sampler, RandomSampler),
            seed=seed,
            drop_last=loader.drop_last,
        )
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
    if iterable:
        return PreparedDataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            drop_last=loader.drop_last,
            device=device,
            **kwargs,
        )
    if loader.batch_size is None:  # user batch_sampler: keep it
        return PreparedDataLoader(
            loader.dataset, batch_sampler=loader.batch_sampler, device=device, **kwargs
        )
    return PreparedDataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        drop_last=loader.drop_last,
        device=device,
        **kwargs,
    )

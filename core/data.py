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

    Each new iteration starts a new epoch and passes it to ``DistributedSampler.set_epoch``, so
    shuffling differs per epoch but agrees across ranks (and does not depend on the global
    RNG). The position within the epoch is tracked so that a checkpoint can resume mid-epoch
    (:meth:`state_dict` / :meth:`load_state_dict`).

    Attributes:
        device: where batches are moved (not moved when it is the CPU).
        epoch: the epoch the current (or next) iteration uses.
        batches_yielded: batches handed out so far in the current epoch.
    """

    def __init__(self, *args: Any, device: torch.device, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device = device
        self.epoch = 0
        self.batches_yielded = 0
        self._skip = 0
        self._in_progress = False
        self._epoch_generator_state: torch.Tensor | None = None

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration, from its start."""
        self.epoch, self.batches_yielded, self._skip, self._in_progress = epoch, 0, 0, False
        self._epoch_generator_state = None

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch comes from: ``epoch``, ``batches_yielded``, and the state of
        the loader's generator at the start of that epoch (it seeds worker processes)."""
        generator_state = self._epoch_generator_state
        if generator_state is None and self.generator is not None:
            generator_state = self.generator.get_state()
        return {
            "epoch": self.epoch,
            "batches_yielded": self.batches_yielded,
            "generator": generator_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a position from :meth:`state_dict`: the next iteration continues that
        epoch, skipping the batches already handed out."""
        self.set_epoch(int(state["epoch"]))
        self._skip = self.batches_yielded = int(state["batches_yielded"])
        if state.get("generator") is not None and self.generator is not None:
            self.generator.set_state(state["generator"])

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self._in_progress:  # the previous iteration was left early: next epoch
            self.set_epoch(self.epoch + 1)
        skip, self._skip = self._skip, 0
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(self.epoch)
        self._in_progress = True
        if self.generator is not None:
            self._epoch_generator_state = self.generator.get_state()
        cpu = self.device.type == "cpu"
        batches: Iterator[tuple[int, Any]] = enumerate(super().__iter__())
        tracker = getattr(self, "gradient_state", None)  # set by Accelerator.prepare
        if tracker is not None:  # marks the last batch: it ends a gradient accumulation
            batches = tracker.track(self, batches)
        for index, batch in batches:
            if index < skip:
                continue
            self.batches_yielded = index + 1
            yield batch if cpu else to_device(batch, self.device)
        self.set_epoch(self.epoch + 1)


def prepare_dataloader(
    loader: DataLoader[Any], device: torch.device, world_size: int, rank: int, seed: int = 0
) -> DataLoader[Any]:
    """Rebuild ``loader`` so that each rank reads its own shard.

    The sampler becomes ``DistributedSampler(dataset, world_size, rank, shuffle=<loader
    shuffled>, seed=seed, drop_last=loader.drop_last)``: every rank gets
    ``ceil(len(dataset) / world_size)`` samples (padded by repeating, torch's semantics), and
    the shuffle order depends on ``seed`` and the epoch only, so a resumed run sees the same
    order (in a single process too). A loader with a custom sampler or batch sampler keeps it,
    since its order is the user's; iterable-style datasets are not resharded.

    Returns:
        A :class:`PreparedDataLoader`.
    """
    custom_sampler = not isinstance(
        loader.sampler, (RandomSampler, torch.utils.data.SequentialSampler)
    )
    iterable = isinstance(loader.dataset, torch.utils.data.IterableDataset)
    if isinstance(loader, PreparedDataLoader):
        return loader
    sampler: Any = loader.sampler
    if not custom_sampler and not iterable:
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
        # A private generator: creating an iterator draws a worker seed from it, and must
        # not consume the global RNG (that would break exact resume).
        "generator": loader.generator or torch.Generator().manual_seed(seed),
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

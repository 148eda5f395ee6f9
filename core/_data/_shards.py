"""Samplers that give each process its part of the data, with Accelerate's semantics.

:class:`BatchSamplerShard` and :class:`IterableDatasetShard` reproduce the batches each rank
receives under ``accelerate.data_loader`` (same names, same arguments), so that a script sees
identical per-rank batches under either library. :class:`SeedableRandomSampler` is the
shuffle of ``DataLoaderConfiguration(use_seedable_sampler=True)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, Sampler

__all__ = ["BatchSamplerShard", "IterableDatasetShard", "SeedableRandomSampler"]


def check_split(batch_size: int | None, num_processes: int, what: str) -> None:
    if batch_size is None or (batch_size > 1 and batch_size % num_processes != 0):
        raise ValueError(
            f"split_batches=True needs the batch size of the {what} ({batch_size}) to be a "
            f"round multiple of the number of processes ({num_processes})"
        )


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose permutation depends only on a seed and the epoch.

    Every iteration reseeds its generator with ``initial_seed + epoch`` and then advances the
    epoch, so every process draws the same order without communicating.

    Args:
        data_source: the data set (sized).
        replacement: as for ``torch.utils.data.RandomSampler``.
        num_samples: as for ``torch.utils.data.RandomSampler``.
        generator: as for ``torch.utils.data.RandomSampler``.
        data_seed: the initial seed; ``None`` (default) uses ``torch.initial_seed()`` (the
            seed given to ``kwplug.utils.set_seed``).
    """

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
        data_seed: int | None = None,
    ) -> None:
        super().__init__(data_source, replacement, num_samples, generator)
        self.initial_seed = data_seed if data_seed is not None else torch.initial_seed()
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration's seed."""
        self.epoch = epoch


class BatchSamplerShard(BatchSampler):
    """The batches of ``batch_sampler`` that belong to one process.

    Without ``split_batches`` process ``p`` gets batches ``p, p + n, p + 2n...`` (``n``
    processes), whole. With it, every batch is cut into ``n`` equal slices and process ``p``
    gets slice ``p``. Unless the batch sampler drops its last batch, the last round is
    completed with indices from the start of the epoch so that every process gets the same
    number of full batches (``even_batches=True``); with ``even_batches=False`` the last round
    is left short and some processes get one batch fewer.

    Args:
        batch_sampler: yields lists of indices (``torch.utils.data.BatchSampler`` or any
            iterable of lists; ``batch_size``/``drop_last`` attributes are read when present,
            a missing ``batch_size`` means batches of varying size).
        num_processes: number of processes (>= 1).
        process_index: this process's rank.
        split_batches: slice each batch instead of dealing whole batches.
        even_batches: complete the last round from the start.

    Raises:
        ValueError: ``split_batches`` and the batch size is unknown or not a multiple of
            ``num_processes``.
    """

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        # BatchSampler.__init__ is not called: the shard has no sampler of its own.
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size: int | None = getattr(batch_sampler, "batch_size", None)  # type: ignore[assignment]
        self.drop_last: bool = getattr(batch_sampler, "drop_last", False)
        if split_batches:
            check_split(self.batch_size, num_processes, "batch sampler")

    @property
    def total_length(self) -> int:
        """Number of batches of the wrapped batch sampler."""
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __len__(self) -> int:
        total = self.total_length
        if self.split_batches or total % self.num_processes == 0:
            return total if self.split_batches else total // self.num_processes
        rounds = total // self.num_processes
        if self.drop_last:
            return rounds
        if self.even_batches:
            return rounds + 1
        return rounds + (1 if self.process_index < total % self.num_processes else 0)

    def __iter__(self) -> Iterator[list[int]]:
        return self._split() if self.split_batches else self._deal()

    def _my_slice(self, batch: list[int]) -> list[int]:
        width = (self.batch_size or 0) // self.num_processes
        return batch[width * self.process_index : width * (self.process_index + 1)]

    def _split(self) -> Iterator[list[int]]:
        first: list[int] = []
        last: list[int] = []
        for index, batch in enumerate(self.batch_sampler):
            if index == 0:
                first = list(batch)
            last = list(batch)
            if len(batch) == self.batch_size:
                yield self._my_slice(last)
        if self.drop_last or not first or len(last) == self.batch_size:
            return
        width = (self.batch_size or 0) // self.num_processes
        if not self.even_batches:
            if len(last) > width * self.process_index:
                yield self._my_slice(last)
            return
        while len(first) < (self.batch_size or 0):  # fewer samples than one batch
            first += first
        yield self._my_slice(last + first)

    def _deal(self) -> Iterator[list[int]]:
        n, rank, size = self.num_processes, self.process_index, self.batch_size
        head: list[Any] = []  # the first n batches, to complete the last round from
        mine: list[int] | None = None
        index, batch = -1, list[int]()
        for index, batch in enumerate(self.batch_sampler):
            if not self.drop_last and index < n:
                head.extend([batch] if size is None else batch)
            if index % n == rank:
                mine = batch
            # A round is handed out only once every process is sure to get a full batch.
            if index % n == n - 1 and (size is None or len(batch) == size):
                assert mine is not None
                yield mine
                mine = None
        if self.drop_last or not head:
            return
        if not self.even_batches:
            if mine:
                yield mine
            return
        if mine and (size is None or len(mine) == size):
            yield mine
        while len(head) < (n if size is None else n * size):
            head += head
        if size is None or len(batch) == size:  # the last batch was handed out whole
            batch, index = [], index + 1
        else:
            batch = list(batch)
        cursor = 0
        while index % n != 0 or batch:
            if size is None:
                batch = head[cursor]
                cursor += 1
            else:
                end = cursor + size - len(batch)
                batch = batch + head[cursor:end]
                cursor = end
            if index % n == rank:
                yield batch
            batch, index = [], index + 1


class IterableDatasetShard(IterableDataset[Any]):
    """The samples of an iterable data set that belong to one process.

    The stream is cut into rounds of ``batch_size * num_processes`` samples (``batch_size``
    with ``split_batches``) and process ``p`` takes the ``p``-th slice of each round. Unless
    ``drop_last``, a short last round is completed with samples from the first round.

    Args:
        dataset: the iterable data set, read whole by every process.
        batch_size: the loader's batch size.
        drop_last: drop a short last round instead of completing it.
        num_processes: number of processes; process_index: this process's rank.
        split_batches: ``batch_size`` is the global batch size.

    Raises:
        ValueError: ``split_batches`` with a batch size that is not a multiple of
            ``num_processes``.
    """

    def __init__(
        self,
        dataset: IterableDataset[Any],
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
    ) -> None:
        if split_batches:
            check_split(batch_size, num_processes, "data loader")
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Record ``epoch`` and pass it to the data set when it has ``set_epoch``."""
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        rounds = len(self.dataset) / (self.batch_size * self.num_processes)  # type: ignore[arg-type]
        return (math.floor(rounds) if self.drop_last else math.ceil(rounds)) * self.batch_size

    def __iter__(self) -> Iterator[Any]:
        generator = getattr(self.dataset, "generator", None)
        if not hasattr(self.dataset, "set_epoch") and isinstance(generator, torch.Generator):
            generator.manual_seed(self.epoch)
        n = self.num_processes
        round_size = self.batch_size if self.split_batches else self.batch_size * n
        width = self.batch_size // n if self.split_batches else self.batch_size
        mine = slice(self.process_index * width, (self.process_index + 1) * width)
        first: list[Any] | None = None
        current: list[Any] = []
        for element in self.dataset:
            current.append(element)
            if len(current) == round_size:
                yield from current[mine]
                first = first if first is not None else current
                current = []
        if self.drop_last or not current:
            return
        first = first if first is not None else list(current)
        while len(current) < round_size:
            current += first
        yield from current[mine]


def sampler_of(loader: Any) -> Sampler[Any] | None:
    """The index sampler inside ``loader``'s batch sampler (or batch-sampler-as-sampler)."""
    holder = loader.sampler if isinstance(loader.sampler, BatchSampler) else loader.batch_sampler
    return getattr(holder, "sampler", None)

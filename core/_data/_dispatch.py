"""Dispatched data loaders (``DataLoaderConfiguration(dispatch_batches=True)``, Accelerate's
default for an ``IterableDataset``): process 0 reads every batch, the others receive it.

The per-rank batches, ``remainder`` and ``end_of_dataloader`` are those of Accelerate's
``DataLoaderDispatcher``: without ``split_batches`` process 0 concatenates ``num_processes``
batches of the loader into one global batch, with it one batch of the loader is the global
batch; every process takes its equal slice. Unless the loader drops its last batch, the last
global batch is completed with the first ``num_processes`` samples of the epoch when its size
is not a multiple of ``num_processes``, and ``remainder`` becomes the number of its real
samples (what ``gather_for_metrics`` keeps).

Only torch's collectives carry the data: one ``broadcast_object_list`` per global batch (its
tensors' shapes and dtypes, whether it is the last, or the error process 0 met while reading)
and one ``broadcast`` per tensor.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import attrs
import torch
import torch.distributed as dist

from kwplug._data._loader import PreparedDataLoader, to_device
from kwplug.utils.structures import (
    concatenate,
    find_batch_size,
    ignorant_find_batch_size,
    recursively_apply,
    slice_tensors,
)

__all__ = ["DispatchedDataLoader"]


@attrs.frozen
class _Leaf:
    """What a process other than 0 needs to allocate one tensor of a dispatched batch."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@attrs.frozen
class _Failure:
    """Process 0 could not read or describe a global batch: the error, re-raised everywhere."""

    error: BaseException


def _is_leaf(value: Any) -> bool:
    return isinstance(value, _Leaf)


def _describe(batch: Any) -> Any:
    def leaf(tensor: torch.Tensor) -> _Leaf:
        return _Leaf(tuple(tensor.shape), tensor.dtype)

    leaf.__name__ = "dispatch_batches"  # named in recursively_apply's TypeError
    return recursively_apply(leaf, batch, error_on_other_type=True)


def _allocate(structure: Any, device: torch.device) -> Any:
    return recursively_apply(
        lambda leaf: torch.empty(leaf.shape, dtype=leaf.dtype, device=device),
        structure,
        test_type=_is_leaf,
    )


def _broadcast(batch: Any) -> Any:
    def one(tensor: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tensor, src=0)
        return tensor

    return recursively_apply(one, batch)


def _not_tensors(exc: TypeError) -> TypeError:
    return TypeError(
        f"dispatch_batches sends tensors only ({exc}); make the collate function return "
        "tensors, or use dispatch_batches=False (each process reads its own batches)"
    )


class DispatchedDataLoader(PreparedDataLoader):
    """A :class:`~kwplug.data.PreparedDataLoader` whose batches are read by process 0 only and
    sent to every process (``dispatch_batches=True``; built by
    :func:`kwplug.data.prepare_dataloader`).

    Batches must be tensors or nested tuples/lists/mappings of tensors (they travel through
    ``torch.distributed.broadcast``); the ``num_processes`` batches of one global batch must
    have the same shape but along the first dimension. Every process creates an iterator of the
    underlying ``DataLoader`` at each epoch start (as Accelerate does; a ``DataPipe`` shares its
    seed across processes there), but only process 0 reads from it. In one process the
    loader's own batches are yielded and ``remainder`` is the size of the last one.

    Attributes:
        remainder: ``-1`` until the last batch of the epoch is reached, then the number of
            real samples in the last global batch (not the ones repeated from the start).

    Raises:
        TypeError: (while iterating, on process 0) a batch holds something other than tensors.
        RuntimeError: (while iterating) process 0 failed to read or send a batch (its error on
            process 0, a ``RuntimeError`` quoting it on the others), or the batches of one
            global batch cannot be concatenated.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._remainder = -1
        # The epoch's first samples (completing its last global batch), kept by a stateful
        # loader's position: a resumed epoch does not read them again.
        self._first: Any = None
        self._resume_first: Any = None

    @property
    def remainder(self) -> int:
        """Real samples of the last global batch once it is reached, else ``-1``."""
        return self._remainder

    def __len__(self) -> int:
        whole = super().__len__()
        if self.sharding.split_batches:
            return whole
        if self.sharding.drop_last:
            return whole // self.sharding.num_processes
        return math.ceil(whole / self.sharding.num_processes)

    def _rank_batches(self, iterator: Iterator[Any], skip: int) -> Iterator[Any]:
        self._remainder = -1
        if self.sharding.num_processes == 1:
            return self._alone(iterator, skip)
        return self._dispatch(iterator, skip)

    def _alone(self, iterator: Iterator[Any], skip: int) -> Iterator[Any]:
        for batch in super()._rank_batches(iterator, skip):
            if self.end_of_dataloader:
                size = ignorant_find_batch_size(batch)
                self._remainder = -1 if size is None else size
            yield batch

    def _global_batches(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """Process 0: the global batches, as Accelerate groups the loader's batches."""
        if self.sharding.split_batches:
            yield from iterator
            return
        n = self.sharding.num_processes
        while group := list(itertools.islice(iterator, n)):
            if len(group) < n and self.sharding.drop_last:
                return
            try:
                batch = concatenate(group, dim=0)
            except TypeError as exc:
                raise _not_tensors(exc) from exc
            except RuntimeError as exc:
                raise RuntimeError(
                    "dispatch_batches: the loader's batches cannot be concatenated into one "
                    f"global batch ({exc}); give every batch the same shape but along the first "
                    "dimension, use split_batches=True (process 0 slices one batch of the "
                    "loader), or dispatch_batches=False (each process reads its own batches)"
                ) from exc
            yield batch
            if len(group) < n:
                return

    def _read(self, source: Iterator[Any] | None) -> Any:
        """Process 0's next global batch on the device, ``_END``, or a :class:`_Failure`."""
        if source is None:
            return _END
        try:
            batch = next(source, _END)
            if batch is _END:
                return _END
            return to_device(batch, self._place, self.sharding.non_blocking)
        except Exception as exc:  # sent to every process, then raised everywhere
            return _Failure(exc)

    @property
    def _place(self) -> torch.device:
        return self.device if self.device is not None else torch.device("cpu")

    def _dispatch(self, iterator: Iterator[Any], skip: int) -> Iterator[Any]:
        n, rank = self.sharding.num_processes, self.sharding.process_index
        source = self._global_batches(iterator) if rank == 0 else None
        current = self._read(source)
        # the epoch's first n samples, to complete the last global batch
        first, self._resume_first = self._resume_first, None
        self._first = first
        index = 0
        while True:
            self._position_reached()
            # structure, last, error (sent as text: an exception may not pickle)
            message: list[Any] = [None, True, None]
            following: Any = _END
            if rank == 0:
                if isinstance(current, _Failure):
                    message[2] = repr(current.error)
                elif current is not _END:
                    try:
                        message[0] = _describe(current)
                    except TypeError as exc:
                        current = _Failure(_not_tensors(exc))
                        message[2] = repr(current.error)
                    else:
                        following = self._read(source)
                        message[1] = following is _END
            dist.broadcast_object_list(message, src=0)
            structure, last, error = message
            if error is not None:
                if isinstance(current, _Failure):  # process 0
                    raise current.error
                raise RuntimeError(f"dispatch_batches: process 0 failed to read a batch: {error}")
            if structure is None:
                return
            batch = _broadcast(current if rank == 0 else _allocate(structure, self._place))
            observed = find_batch_size(batch)
            width = observed // n
            if first is None and not self.sharding.drop_last:
                first = self._first = slice_tensors(batch, slice(0, n))
            if last and not self.sharding.drop_last and observed % n:
                batch, width = concatenate([batch, first], dim=0), width + 1
            mine = slice_tensors(batch, slice(rank * width, (rank + 1) * width))
            self.end_of_dataloader = last
            if last:
                self._remainder = observed
            if index >= skip:
                self.batches_yielded += 1
                yield mine
            if last:
                return
            index += 1
            current = following


_END: Any = object()

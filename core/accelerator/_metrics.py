"""Distributed metrics: gather, reduce and pad nested data, and ``gather_for_metrics``, which
drops the samples the sharding repeated to even out the last batch."""

from __future__ import annotations

import logging
import warnings
from typing import Any, Literal

import torch

from kwplug.data import ActiveLoaders, IterableDatasetShard
from kwplug.errors import KwplugWarning
from kwplug.utils import operations
from kwplug.utils.structures import recursively_apply

logger = logging.getLogger(__name__)


def _all_tensors(data: Any) -> bool:
    try:
        recursively_apply(lambda t: t, data, error_on_other_type=True)
    except TypeError:
        return False
    return True


def gather(data: Any) -> Any:
    """Every tensor of nested ``data`` concatenated across processes along dim 0
    (:func:`kwplug.utils.gather`; mismatched shapes raise naming each rank's)."""
    return operations.gather(data)


def reduce(data: Any, reduction: Literal["sum", "mean", "max"] = "sum") -> Any:
    """Reduced copies of every tensor of nested ``data`` (:func:`kwplug.utils.reduce`)."""
    return operations.reduce(data, reduction=reduction)


def gather_for_metrics(data: Any, use_gather_object: bool, loaders: ActiveLoaders) -> Any:
    """Gather ``data`` and, on the last batch of the active prepared loader, keep only the
    first ``remainder`` samples: the rest were repeated from the start of the data set to
    give every process a full last batch.

    ``data`` that is not all tensors (or ``use_gather_object=True``) is gathered as Python
    objects (:func:`kwplug.utils.gather_object`) and the resulting list is truncated.
    """
    use_gather_object = use_gather_object or not _all_tensors(data)
    gathered = operations.gather_object(data) if use_gather_object else operations.gather(data)
    if not loaders.end_of_dataloader:
        return gathered
    remainder = loaders.remainder
    if remainder == -1:
        logger.info(
            "gather_for_metrics: the data loader's length or batch size is unknown, so "
            "samples repeated to even out the last batch may be counted twice"
        )
        return gathered
    if remainder == 0:  # the last global batch was full: nothing repeated
        return gathered
    _warn_if_accelerate_counts_padding(loaders)
    if use_gather_object:
        return gathered[:remainder]
    return recursively_apply(lambda t: t[:remainder], gathered)


def _warn_if_accelerate_counts_padding(loaders: ActiveLoaders) -> None:
    # A deliberate difference must reach the user at the call, not as other numbers:
    # Accelerate records no remainder for a sharded (not dispatched) iterable data set, so its
    # gather_for_metrics keeps the padding samples that kwplug drops here.
    loader = loaders.active
    if isinstance(getattr(loader, "dataset", None), IterableDatasetShard):
        warnings.warn(
            "gather_for_metrics drops the samples repeated to fill the last batch of an "
            "IterableDataset prepared with dispatch_batches=False (the true sample count); "
            "Accelerate keeps them and counts those samples twice. Use dispatch_batches=None "
            "(the default) to get the same numbers from both",
            KwplugWarning,
            stacklevel=4,
        )


def pad_across_processes(
    data: Any, dim: int = 0, pad_index: int | float = 0, pad_first: bool = False
) -> Any:
    """Pad every tensor of nested ``data`` along ``dim`` to the longest on any process
    (:func:`kwplug.utils.pad_across_processes`)."""
    return operations.pad_across_processes(data, dim=dim, pad_index=pad_index, pad_first=pad_first)


def trigger_tensor(value: int, device: torch.device) -> torch.Tensor:
    """The flag :meth:`~kwplug.Accelerator.set_trigger` sets and ``check_trigger`` sums."""
    return torch.tensor(value, device=device)

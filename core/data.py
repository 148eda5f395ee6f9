"""Prepared data loaders: each rank's batches as under Accelerate, moved to the device.

The implementation lives in the private ``kwplug._data`` package; these are the public names,
and :func:`skip_first_batches` (``accelerator.skip_first_batches``, Accelerate's
``accelerate.data_loader.skip_first_batches``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from kwplug._data import (
    ActiveLoaders,
    BatchSamplerShard,
    DispatchedDataLoader,
    IterableDatasetShard,
    PreparedDataLoader,
    SeedableRandomSampler,
    prepare_dataloader,
    to_device,
)

__all__ = [
    "ActiveLoaders",
    "BatchSamplerShard",
    "DispatchedDataLoader",
    "IterableDatasetShard",
    "PreparedDataLoader",
    "SeedableRandomSampler",
    "prepare_dataloader",
    "skip_first_batches",
    "to_device",
]


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """Make the next iteration of ``dataloader`` skip its first ``num_batches`` batches
    (Accelerate's function; ``accelerator.skip_first_batches`` without an Accelerator).

    A prepared loader is returned itself. A plain ``torch.utils.data.DataLoader`` kwplug did
    not prepare (Accelerate accepts one too) is rebuilt as a one-process prepared loader over
    the same data set, sampler and collate function (batches left where the collate function
    puts them), whose next iteration skips; the original is left as it is.

    Raises:
        TypeError: ``dataloader`` is not a ``DataLoader``.
        ValueError: ``num_batches < 0``.
    """
    if num_batches < 0:
        raise ValueError(f"num_batches must be >= 0, got {num_batches}")
    if not isinstance(dataloader, PreparedDataLoader):
        if not isinstance(dataloader, DataLoader):
            raise TypeError(
                "skip_first_batches needs a torch.utils.data.DataLoader, got "
                f"{type(dataloader).__name__}"
            )
        dataloader = prepare_dataloader(dataloader, torch.device("cpu"), 1, 0)
    dataloader.skip_first_batches(num_batches)
    return dataloader

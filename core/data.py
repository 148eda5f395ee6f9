"""Prepared data loaders: each rank's batches as under Accelerate, moved to the device.

The implementation lives in the private ``kwplug._data`` package; these are the public names,
and :func:`skip_first_batches` (``accelerator.skip_first_batches``, Accelerate's
``accelerate.data_loader.skip_first_batches``).
"""

from __future__ import annotations

from typing import Any

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
    """Make the next iteration of a prepared ``dataloader`` skip its first ``num_batches``
    batches (Accelerate's function; ``accelerator.skip_first_batches`` without an
    Accelerator). Returns the same loader.

    Raises:
        TypeError: ``dataloader`` was not prepared by kwplug.
        ValueError: ``num_batches < 0``.
    """
    if not isinstance(dataloader, PreparedDataLoader):
        raise TypeError(
            "skip_first_batches needs a data loader returned by accelerator.prepare (or "
            f"prepare_data_loader), got {type(dataloader).__name__}"
        )
    dataloader.skip_first_batches(num_batches)
    return dataloader

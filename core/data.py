"""Prepared data loaders: each rank's batches as under Accelerate, moved to the device.

The implementation lives in the private ``kwplug._data`` package; these are the public names.
"""

from __future__ import annotations

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
    "to_device",
]

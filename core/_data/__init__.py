"""Private implementation of :mod:`kwplug.data` (prepared data loaders and shard samplers)."""

from __future__ import annotations

from kwplug._data._dispatch import DispatchedDataLoader
from kwplug._data._loader import (
    ActiveLoaders,
    PreparedDataLoader,
    Sharding,
    SkippableBatches,
    to_device,
)
from kwplug._data._prepare import prepare_dataloader
from kwplug._data._shards import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler

__all__ = [
    "ActiveLoaders",
    "BatchSamplerShard",
    "DispatchedDataLoader",
    "IterableDatasetShard",
    "PreparedDataLoader",
    "SeedableRandomSampler",
    "Sharding",
    "SkippableBatches",
    "prepare_dataloader",
    "to_device",
]

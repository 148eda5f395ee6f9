"""Accelerate's module name for the prepared data loaders: ``from accelerate.data_loader
import ...`` ports as ``from kwplug.data_loader import ...``.

The same objects as :mod:`kwplug.data` (kwplug's own name for the module), plus
``DataLoaderShard``, Accelerate's name of the class of a prepared data loader
(:class:`~kwplug.data.PreparedDataLoader`: what ``accelerator.prepare`` returns for a
``DataLoader``, so ``isinstance(loader, DataLoaderShard)`` holds as under Accelerate).
"""

from __future__ import annotations

from kwplug.data import (
    ActiveLoaders,
    BatchSamplerShard,
    IterableDatasetShard,
    PreparedDataLoader,
    SeedableRandomSampler,
    prepare_dataloader,
    to_device,
)

#: Accelerate's name of the prepared data loader class.
DataLoaderShard = PreparedDataLoader

__all__ = [
    "ActiveLoaders",
    "BatchSamplerShard",
    "DataLoaderShard",
    "IterableDatasetShard",
    "PreparedDataLoader",
    "SeedableRandomSampler",
    "prepare_dataloader",
    "to_device",
]

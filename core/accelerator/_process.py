"""What the run looks like to the ``Accelerator``: its ``distributed_type`` (data parallel, or
``FSDP`` from a handler or a sharded prepared model). The rank predicates and "which process
runs what" live below, in :mod:`kwplug._runtime` (shared with :mod:`kwplug.state`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from kwplug.utils.dataclasses import DistributedType, default_distributed_type


def distributed_type(
    device: torch.device,
    num_processes: int,
    handlers: Iterable[Any],
    models: Iterable[Any],
    declared_by_device: DistributedType | None = None,
) -> DistributedType:
    """``FSDP`` when a handler declares it (a ``distributed_type`` class attribute) or a
    prepared model is sharded (FSDP1 wrapper, FSDP2 module, ``DTensor`` parameters); else what
    the device's ``select_device`` plugin declared (``declared_by_device``); else plain data
    parallelism's type for the device
    (:func:`~kwplug.utils.dataclasses.default_distributed_type`)."""
    for handler in handlers:
        declared = getattr(handler, "distributed_type", None)
        if declared is not None:
            return DistributedType(declared)
    if num_processes > 1 and any(_is_sharded(model) for model in models):
        return DistributedType.FSDP
    if declared_by_device is not None:
        return declared_by_device
    return default_distributed_type(device.type, num_processes)


def _is_sharded(model: torch.nn.Module) -> bool:
    fsdp = getattr(torch.distributed, "fsdp", None)
    kinds = tuple(
        kind
        for kind in (
            getattr(fsdp, "FSDPModule", None),
            getattr(fsdp, "FullyShardedDataParallel", None),
        )
        if isinstance(kind, type)
    )
    if kinds and any(isinstance(m, kinds) for m in model.modules()):
        return True
    return any(type(p).__name__ == "DTensor" for p in model.parameters())

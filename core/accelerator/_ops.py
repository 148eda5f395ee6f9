"""Plain tensor collectives of the Accelerator itself: reduce (triggers), barrier.

User-facing gather/reduce of nested data go through :mod:`._metrics` (shape-checked).

Each takes the number of processes and is a no-op (or a copy) in a single process, so that
the same training script runs under ``python`` and ``torchrun``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist


def reduce(
    tensor: torch.Tensor, num_processes: int, reduction: Literal["sum", "mean"] = "sum"
) -> torch.Tensor:
    """All-reduce a copy of ``tensor`` with ``"sum"`` or ``"mean"``.

    Raises:
        ValueError: ``reduction`` is not ``"sum"`` or ``"mean"``.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    result = tensor.clone()
    if num_processes > 1:
        dist.all_reduce(result, op=dist.ReduceOp.SUM)
        if reduction == "mean":
            result = result / num_processes
    return result


def wait_for_everyone(num_processes: int) -> None:
    """``torch.distributed.barrier()`` when distributed; nothing otherwise."""
    if num_processes > 1:
        dist.barrier()

"""Plain tensor collectives of the Accelerator itself: reduce (triggers), and the barrier
(:func:`kwplug._runtime.wait_for_everyone`, shared with :mod:`kwplug.state`).

User-facing gather/reduce of nested data go through :mod:`._metrics` (shape-checked).

Each takes the number of processes and is a no-op (or a copy) in a single process, so that
the same training script runs under ``python`` and ``torchrun``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from kwplug._runtime import wait_for_everyone as wait_for_everyone


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

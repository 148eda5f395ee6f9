"""Collectives across the training processes: gather, reduce, barrier.

Each takes the number of processes and is a no-op (or a copy) in a single process, so that
the same training script runs under ``python`` and ``torchrun``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist


def gather(tensor: torch.Tensor, num_processes: int) -> torch.Tensor:
    """Concatenate ``tensor`` from every rank along dim 0 (0-d tensors become 1-d).

    Every rank must pass the same shape. Single process: ``tensor`` itself (0-d made 1-d).
    """
    if tensor.dim() == 0:
        tensor = tensor.unsqueeze(0)
    if num_processes <= 1:
        return tensor
    out = [torch.empty_like(tensor) for _ in range(num_processes)]
    dist.all_gather(out, tensor.contiguous())
    return torch.cat(out, dim=0)


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

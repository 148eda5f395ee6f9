"""Gradient-norm clipping over plain tensors and ``DTensor`` gradients (sharded or
tensor-parallel parameters), as Accelerate's ``_clip_grad_norm_dtensor_aware``.

``torch.nn.utils.clip_grad_norm_`` cannot stack the norms of gradients living on different
device meshes (or mix them with plain tensors), and over ``DTensor`` objects it returns a
``DTensor``. Here the gradients are grouped by mesh, each group's norm is
``torch.nn.utils.get_total_norm`` made a full tensor, the total is their norm, and every group
is clipped with ``torch.nn.utils.clip_grads_with_norm_`` against that one total: the value is
the unsharded model's norm.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def clip_grad_norm(parameters: Iterable[Any], max_norm: float, norm_type: float) -> torch.Tensor:
    """The total norm (a plain 0-d tensor) of the gradients of ``parameters``, clipped to
    ``max_norm`` unless it is ``inf``."""
    params = list(parameters)
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p.grad, DTensor) for p in params if p.grad is not None):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    groups: dict[Any, list[Any]] = {}
    for param in params:
        if param.grad is not None:
            key = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault(key, []).append(param)
    norms: list[torch.Tensor] = []
    for group in groups.values():
        if norm_type == 0:  # a count of nonzero entries: each gradient's, made whole first
            norms.extend(_full(torch.linalg.vector_norm(p.grad, 0)) for p in group)
        else:
            norms.append(_full(torch.nn.utils.get_total_norm([p.grad for p in group], norm_type)))
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if max_norm != float("inf"):
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _full(norm: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    full: torch.Tensor = norm.full_tensor() if isinstance(norm, DTensor) else norm
    return full

"""A resumed run's first step on the saved run's buckets.

A new ``DistributedDataParallel`` runs its first step with its initial buckets (all
parameters in one, in ``model.parameters()`` order) and rebuilds them afterwards in
gradient-ready order; the run that saved a checkpoint had rebuilt them already. Top-k's
selection and int8's chunks depend on the bucket, so the first resumed step cuts DDP's bucket
into the saved buckets (:meth:`~kwplug_compress.state.ResidualMemory.tiles`), runs the hook
on each one with its saved index, parameter order and restored residual, and writes the
averages back: what the uninterrupted run computed at that step, bit for bit.

No ``from __future__ import annotations``: see :mod:`kwplug_compress.hooks`.
"""

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from kwplug_compress.state import BucketIndex, Int8State, TopKState

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket
else:
    GradBucket = dist.GradBucket

_State = TypeVar("_State", Int8State, TopKState)
_Hook = Callable[[_State, GradBucket], "torch.futures.Future[torch.Tensor]"]


class _TileBucket:
    # The GradBucket methods the hooks call, for one saved bucket cut from DDP's.
    __slots__ = ("_buffer", "_index", "_parameters")

    def __init__(
        self, buffer: torch.Tensor, index: BucketIndex, parameters: list[torch.Tensor]
    ) -> None:
        self._buffer, self._index, self._parameters = buffer, index, parameters

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> BucketIndex:
        return self._index

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters


def run_tiled(
    hook: "_Hook[_State]", state: _State, bucket: GradBucket
) -> "torch.futures.Future[torch.Tensor] | None":
    """Run ``hook`` on the saved buckets that tile ``bucket``, or return ``None`` when the
    bucket runs whole (not a resumed run's first step, or the saved buckets are DDP's).

    Args:
        hook: the hook (``int8_hook``/``topk_hook``) to run on each tile.
        state: its state.
        bucket: the bucket DDP handed over.

    Returns:
        A future of ``bucket.buffer()`` holding the tiles' averages, or ``None``.
    """
    parameters = list(bucket.parameters())
    members = state.memory.members(bucket.index(), parameters)
    tiles = state.memory.tiles(bucket.index(), members)
    if tiles is None:
        return None
    flat = bucket.buffer().view(-1)
    numels = [math.prod(p.shape) for p in parameters]
    offsets = [sum(numels[:n]) for n in range(len(numels))]
    pieces: list[list[torch.Tensor]] = []
    futures = []
    for saved_index, positions in tiles:
        views = [flat.narrow(0, offsets[n], numels[n]) for n in positions]
        tile = _TileBucket(torch.cat(views), saved_index, [parameters[n] for n in positions])
        pieces.append(views)
        futures.append(hook(state, tile))  # type: ignore[arg-type]

    def scatter(done: "torch.futures.Future[list[torch.futures.Future[Any]]]") -> torch.Tensor:
        for views, future in zip(pieces, done.value(), strict=True):
            result, start = future.value(), 0
            for view in views:
                view.copy_(result.narrow(0, start, view.numel()))
                start += view.numel()
        return bucket.buffer()

    return torch.futures.collect_all(futures).then(scatter)

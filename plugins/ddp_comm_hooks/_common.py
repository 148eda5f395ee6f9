"""Helpers shared by kwplug's communication hooks: futures, group size, readable names.

No ``from __future__ import annotations`` in this package: DDP compares a hook's ``bucket``
and return annotations with ``torch.distributed.GradBucket`` and
``torch.futures.Future[torch.Tensor]`` *objects*, so string annotations would be rejected.
"""

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket
else:
    # The very object DDP compares hook annotations with (torch.distributed.GradBucket).
    GradBucket = dist.GradBucket

__all__ = ["GradBucket", "all_reduce_async", "describe", "future_tensor", "world_size"]


def world_size(process_group: dist.ProcessGroup | None) -> int:
    # ``group=None`` means the default group for every torch.distributed call. Callbacks below
    # never capture a ProcessGroup: a callback released on the backend's worker thread after
    # destroy_process_group() would drop the last reference there, and the group's destructor
    # would join that very thread (std::system_error "Resource deadlock avoided").
    return dist.get_world_size(process_group)


def describe(hook: Any) -> str:
    # A readable name for DDP's logs and kwplug's messages, for functions, partials and objects.
    func = getattr(hook, "func", None)
    if func is not None and not isinstance(getattr(hook, "__qualname__", None), str):
        return f"partial({describe(func)})"
    name = getattr(hook, "__qualname__", None)
    return name if isinstance(name, str) else type(hook).__qualname__


def all_reduce_async(
    tensor: torch.Tensor, process_group: dist.ProcessGroup | None
) -> torch.futures.Future[list[torch.Tensor]]:
    # Sum over the group (``None`` = default group) in place; the future holds [tensor].
    work = dist.all_reduce(tensor, group=process_group, async_op=True)
    if work is None:  # only when this rank is not in the group
        raise RuntimeError("this process is not a member of the hook's process group")
    return cast("torch.futures.Future[list[torch.Tensor]]", work.get_future())


def future_tensor(fut: torch.futures.Future[Any]) -> torch.Tensor:
    # all_reduce futures hold a list with one tensor, hook futures hold the tensor itself.
    value = fut.value()
    if isinstance(value, (list, tuple)):
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            "a DDP communication hook's future must hold a torch.Tensor (or a one-tensor "
            f"list), got {type(value).__name__}"
        )
    return value

"""The hook DDP registers: a :class:`~kwplug.CommHook`'s function with its compression wrapper,
gloo ordering and canonical buckets, in that order from the inside out."""

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from kwplug.comm_hooks import CommHook, HookFn
from kwplug.plugins.ddp_comm_hooks._adapters import ddp_compatible_hook, ordered_hook
from kwplug.plugins.ddp_comm_hooks._canonical import canonical_bucket_hook


def _on_gloo(state: Any) -> bool:
    # A hook's state may carry its process group (None: the default group).
    group = getattr(state, "process_group", None)
    return bool(dist.is_initialized() and dist.get_backend(group) == "gloo")


def compose(
    record: CommHook,
    state: Any,
    parameters: Iterable[torch.Tensor] = (),
    *,
    wrapper: Callable[[HookFn], HookFn] | None = None,
) -> HookFn:
    """Build the callable ``DistributedDataParallel.register_comm_hook(state, ...)`` takes.

    From the inside out:

    1. ``record.hook``;
    2. on gloo, when ``record.chains_collectives``,
       :func:`~kwplug.plugins.ddp_comm_hooks.ordered_hook` (each bucket's hook started after
       the previous bucket's future completed, without blocking backward);
    3. ``wrapper`` (a ``comm_wrapper``: the hook runs on a low-precision copy);
    4. when ``record.layout_dependent`` (it has ``state_buckets``),
       :func:`~kwplug.plugins.ddp_comm_hooks.canonical_bucket_hook` with ``parameters`` as
       the canonical order and ``record.state_buckets``; outermost, so that the wrapper's
       low-precision copy is canonical as well;
    5. :func:`~kwplug.plugins.ddp_comm_hooks.ddp_compatible_hook`, so that DDP's signature
       checks accept the result.

    Args:
        record: the hook and its rules.
        state: the state it is registered with (its ``process_group`` attribute, if any,
            decides whether it runs on gloo; else the default group's backend does).
        parameters: the model's parameters, in order (only used for a layout-dependent hook).
        wrapper: optional ``wrapper(hook) -> hook``.

    Returns:
        A hook DDP accepts.
    """
    hook = record.hook
    if record.chains_collectives and _on_gloo(state):
        hook = ordered_hook(hook)
    if wrapper is not None:
        hook = wrapper(hook)
    if record.state_buckets is not None:
        hook = canonical_bucket_hook(hook, parameters, state_buckets=record.state_buckets)
    return ddp_compatible_hook(hook)

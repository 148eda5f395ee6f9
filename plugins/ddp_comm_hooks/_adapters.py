"""Making any callable acceptable to DDP, and the gloo serialisation of multi-collective hooks."""

import inspect
from typing import Any

import torch

from kwplug.comm_hooks import HookFn
from kwplug.plugins.ddp_comm_hooks._common import GradBucket, describe, future_tensor

#: Attribute of a hook function that issues its collectives in the same order on every rank
#: without waiting (e.g. on separate process groups), so :func:`serialized_hook` leaves it as is.
ORDERS_COLLECTIVES = "_kwplug_orders_collectives"


def serialized_hook(hook: HookFn) -> HookFn:
    """Run ``hook`` to completion inside the call and return an already completed future.

    gloo completes futures on its own worker threads, so a hook that starts a second
    collective from a ``then`` callback (PowerSGD all-reduces ``Q`` after ``P``) issues it from
    that thread while DDP's autograd thread may already be starting the next bucket's first
    collective. The two ranks can then issue them in different orders, and gloo matches
    collectives by order: the job hangs. Waiting inside the hook issues every collective of a
    bucket before the next bucket's hook starts, in the same order on every rank. The cost is
    the overlap of this hook's communication with the rest of the backward pass; kwplug applies
    it on gloo only (NCCL orders collectives on CUDA streams).

    A hook that keeps its collectives in order itself (kwplug's
    :func:`~kwplug.plugins.ddp_comm_hooks.batched_power_sgd_hook`, marked by a true
    :data:`ORDERS_COLLECTIVES` attribute) is returned unchanged.

    Args:
        hook: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``.

    Returns:
        A hook with the same contract whose future is already done, or ``hook``.
    """
    if getattr(hook, ORDERS_COLLECTIVES, False):
        return hook

    def serial_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        future = hook(state, bucket)
        future.wait()  # raises what the hook's chain raised
        result = future_tensor(future)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(result)
        return done

    serial_hook.__name__ = getattr(hook, "__name__", None) or "serialized_hook"
    serial_hook.__qualname__ = describe(hook)
    serial_hook.__doc__ = f"{describe(hook)}, completed before returning (kwplug, gloo)."
    return serial_hook


def _accepted_by_ddp(hook: Any) -> bool:
    # Mirrors the introspection DistributedDataParallel.register_comm_hook applies, which
    # fails for reasons unrelated to the hook's behaviour: no __name__/__qualname__
    # (functools.partial, callable objects), no parameter literally named "bucket", or
    # string annotations (a module using "from __future__ import annotations").
    if not isinstance(getattr(hook, "__name__", None), str):
        return False
    if not isinstance(getattr(hook, "__qualname__", None), str):
        return False
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return False
    bucket = signature.parameters.get("bucket")
    if bucket is None:
        return False
    return not isinstance(bucket.annotation, str) and not isinstance(
        signature.return_annotation, str
    )


def ddp_compatible_hook(hook: HookFn) -> HookFn:
    """Return ``hook``, or a plain function calling it, so that DDP's checks accept it.

    ``DistributedDataParallel.register_comm_hook`` inspects the hook: it reads
    ``hook.__name__`` and ``hook.__qualname__``, the annotation of a parameter that must be
    named ``bucket``, and compares annotations with objects (string annotations fail). A hook
    that would fail only these checks (a ``functools.partial``, a callable object, a
    ``hook(state, grad_bucket)`` signature, a module with ``from __future__ import
    annotations``) is wrapped in ``kwplug_comm_hook(state, bucket)`` calling it positionally.

    Args:
        hook: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``.

    Returns:
        ``hook`` itself when DDP accepts it as is, else the adapter.

    Raises:
        TypeError: ``hook`` is not callable.
    """
    if not callable(hook):
        raise TypeError(f"a communication hook must be callable, got {hook!r}")
    if _accepted_by_ddp(hook):
        return hook

    def kwplug_comm_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        return hook(state, bucket)

    kwplug_comm_hook.__qualname__ = f"kwplug_comm_hook[{describe(hook)}]"
    return kwplug_comm_hook

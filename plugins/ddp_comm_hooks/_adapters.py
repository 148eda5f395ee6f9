"""Making any callable acceptable to DDP, and the gloo ordering of multi-collective hooks."""

import contextlib
import inspect
from typing import Any

import torch

from kwplug.comm_hooks import HookFn
from kwplug.plugins.ddp_comm_hooks._common import GradBucket, describe, future_tensor

#: Attribute of a hook function that issues its collectives in the same order on every rank
#: without waiting (e.g. on separate process groups), so :func:`ordered_hook` and
#: :func:`serialized_hook` leave it as is.
ORDERS_COLLECTIVES = "_kwplug_orders_collectives"


def _settle(source: torch.futures.Future[Any], target: torch.futures.Future[torch.Tensor]) -> None:
    # Hand a finished hook future's tensor, or its error, on to the future DDP holds.
    try:
        value = future_tensor(source)
    except BaseException as error:  # handed to DDP through the future
        target.set_exception(error)  # type: ignore[arg-type]  # torch's stub is too narrow
        return
    target.set_result(value)


#: Name of an optional method of a hook's state, ``kwplug_lanes() -> tuple[state, ...]``: views
#: of the state that each issue the hook's collectives on a process group of their own (the
#: first is normally the state itself). :func:`ordered_hook` runs bucket ``n`` of a step on
#: lane ``n % len(lanes)``, so that the buckets of different lanes overlap.
LANES = "kwplug_lanes"


def _lanes(state: Any) -> tuple[Any, ...]:
    lanes = getattr(state, LANES, None)
    views = tuple(lanes()) if callable(lanes) else ()
    return views or (state,)


class _Chain:
    # One step's chain: the future set once the latest bucket's hook was called (its
    # synchronous part, random draws included, done), each lane's latest bucket, every bucket.
    __slots__ = ("count", "ends", "results", "started")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.started: torch.futures.Future[None] | None = None
        self.ends: dict[int, torch.futures.Future[torch.Tensor]] = {}
        self.results: list[torch.futures.Future[torch.Tensor]] = []


def ordered_hook(hook: HookFn) -> HookFn:
    """Chain ``hook``'s buckets so that each starts after the previous one's future completed.

    gloo completes futures on its own worker threads, so a hook that starts a second
    collective from a ``then`` callback (PowerSGD all-reduces ``Q`` after ``P``) issues it from
    that thread while DDP's autograd thread may already be starting the next bucket's first
    collective; the ranks can then issue them in different orders, and gloo, which matches
    collectives by order, hangs. The returned hook keeps one order on every rank without
    making the autograd thread wait: called for bucket ``k``, it returns a new future at once
    and runs ``hook`` for bucket ``k`` from a done-callback of bucket ``k - 1``'s future (or
    at once when that one is already done), so every collective of bucket ``k - 1`` is issued
    before the first of bucket ``k``, while backward keeps computing the next gradients.

    For the step's last bucket (``bucket.is_last()``) it waits until the chain is done before
    returning: nothing of backward is left to overlap, and any collective DDP itself issues
    after the last bucket on the same group (the unused-parameter map of
    ``find_unused_parameters=True``) then comes after the hook's on every rank. The next
    step's first bucket therefore starts at once.

    When the state offers lanes (a :data:`LANES` method, e.g. kwplug's PowerSGD state on gloo
    with warm start, whose second lane all-reduces on a second gloo group), bucket ``n`` runs
    on lane ``n % len(lanes)``, with that lane's view of the state: it starts once bucket
    ``n - 1``'s hook was called and the lane's previous bucket completed. Each group then sees
    its buckets' collectives in one order on every rank, the hook is still called in bucket
    order (its random draws too), and the chains of consecutive buckets overlap. The last
    bucket waits for every lane. A hook that raises, or whose future fails,
    fails the future of its bucket (DDP raises it at the end of backward); the chain goes on
    with the next bucket, so the other ranks' collectives are still matched. One chain per
    returned hook (one DDP model); the work each bucket does, and its order, are unchanged.

    A hook that keeps its collectives in order itself (kwplug's
    :func:`~kwplug.plugins.ddp_comm_hooks.batched_power_sgd_hook`, marked by a true
    :data:`ORDERS_COLLECTIVES` attribute) is returned unchanged.

    Args:
        hook: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``.

    Returns:
        A hook with the same contract, or ``hook``.
    """
    if getattr(hook, ORDERS_COLLECTIVES, False):
        return hook
    # Only DDP's autograd thread reads or sets the chain; callbacks only complete futures.
    chain = _Chain()

    def chained_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        lanes = _lanes(state)
        lane = chain.count % len(lanes)
        chain.count += 1
        result: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        started: torch.futures.Future[None] = torch.futures.Future()

        def start(_: object = None) -> None:
            # Runs on this thread, or on the gloo thread that completed what it waited for.
            try:
                inner = hook(lanes[lane], bucket)
            except BaseException as error:  # handed to DDP through the future
                started.set_result(None)
                result.set_exception(error)  # type: ignore[arg-type]  # torch's stub is too narrow
                return
            started.set_result(None)
            inner.add_done_callback(lambda fut: _settle(fut, result))

        after_start, lane_end = chain.started, chain.ends.get(lane)

        def when_started(_: object = None) -> None:
            if lane_end is None:
                start()
            else:  # runs at once when that bucket is already done
                lane_end.add_done_callback(start)

        if after_start is None:
            when_started()
        else:
            after_start.add_done_callback(when_started)
        chain.started = started
        chain.ends[lane] = result
        chain.results.append(result)
        if not bucket.is_last():
            return result
        step = chain.results
        chain.reset()
        # A failed bucket's error stays in its future: DDP raises it when backward finishes.
        for future in step:
            with contextlib.suppress(Exception):
                future.wait()
        return result

    chained_hook.__name__ = getattr(hook, "__name__", None) or "ordered_hook"
    chained_hook.__qualname__ = describe(hook)
    chained_hook.__doc__ = f"{describe(hook)}, buckets chained in order (kwplug, gloo)."
    return chained_hook


def serialized_hook(hook: HookFn) -> HookFn:
    """Run ``hook`` to completion inside the call and return an already completed future.

    kwplug itself now uses :func:`ordered_hook` (same order guarantee, without making the
    autograd thread wait for every bucket); this stays for hooks registered by hand.

    gloo completes futures on its own worker threads, so a hook that starts a second
    collective from a ``then`` callback (PowerSGD all-reduces ``Q`` after ``P``) issues it from
    that thread while DDP's autograd thread may already be starting the next bucket's first
    collective. The two ranks can then issue them in different orders, and gloo matches
    collectives by order: the job hangs. Waiting inside the hook issues every collective of a
    bucket before the next bucket's hook starts, in the same order on every rank. The cost is
    the overlap of this hook's communication with the rest of the backward pass.

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

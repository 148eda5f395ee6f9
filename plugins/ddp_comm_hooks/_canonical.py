"""The canonical bucket layout: hook state that does not depend on DDP's bucket layout.

DDP rebuilds its buckets after the first step, in the order gradients became ready, so a hook
whose state is keyed by ``bucket.index()`` and laid out like ``bucket.buffer()`` (PowerSGD)
sees another layout in a freshly built DDP than in the process that saved its state.
:func:`canonical_bucket_hook` hands such a hook a :class:`CanonicalBucket` instead.

A canonical bucket's key names its parameters by their index in ``model.parameters()``, in
the order DDP's bucket held them when the hook's state first got the key (on DDP's own layout
the hook computes what it computes unwrapped: Accelerate's weights), or, when the state's
keys are not known, in the parameters' own order. How a real bucket is cut into canonical
buckets, and the layout a state records for checkpoints, is :mod:`._bucket_plan`.
"""

import itertools
import math
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from kwplug.comm_hooks import HookFn
from kwplug.plugins.ddp_comm_hooks._bucket_plan import (
    BucketKey,
    Group,
    LayoutRecorder,
    Plan,
    known_keys,
    make_plan,
)
from kwplug.plugins.ddp_comm_hooks._common import GradBucket, describe, future_tensor

#: Attribute of a hook function that works only through ``bucket.gradients()``, in place,
#: and keeps no state laid out like ``bucket.buffer()`` (kwplug's ``power_sgd_inplace_hook``):
#: :func:`canonical_bucket_hook` then hands it the real buffer with the gradients as views
#: into it, in canonical order, instead of gathering a canonical copy and scattering it back.
IN_PLACE_VIEWS = "_kwplug_in_place_views"


class CanonicalBucket:
    """A layout-independent stand-in for a ``torch.distributed.GradBucket``.

    Built by :func:`canonical_bucket_hook` for the hook it wraps. It offers the methods
    PowerSGD, kwplug's hooks and the compression wrappers call on a bucket, with the bucket's
    parameters in their canonical order (the order of :meth:`index`, which the hook's state
    records) rather than in the current DDP's bucket order, which a fresh DDP does not share
    with the one that built the state (DDP rebuilds its buckets after the first step).

    Args:
        buffer: the flat gradients of the parameters, concatenated in canonical order.
        key: what :meth:`index` returns, the parameters' indices in canonical order.
        is_last: what :meth:`is_last` returns.
        parameters: the parameters, in canonical order.
        shapes: the gradients' shapes, in canonical order (their sizes add up to the
            buffer's length).
    """

    __slots__ = ("_buffer", "_is_last", "_key", "_parameters", "_shapes", "_views")

    def __init__(
        self,
        buffer: torch.Tensor,
        key: BucketKey,
        is_last: bool,
        parameters: list[torch.Tensor],
        shapes: list[torch.Size],
        views: list[torch.Tensor] | None = None,
    ) -> None:
        self._buffer = buffer
        self._key = key
        self._is_last = is_last
        self._parameters = parameters
        self._shapes = shapes
        # For an IN_PLACE_VIEWS hook: the gradients, views into DDP's own buffer.
        self._views = views

    def buffer(self) -> torch.Tensor:
        """The flat gradient buffer, in canonical order (or what :meth:`set_buffer` set)."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the buffer (same number of elements; e.g. a low-precision copy)."""
        if tensor.numel() != self._buffer.numel():
            raise ValueError(
                f"set_buffer: the bucket holds {self._buffer.numel()} elements, "
                f"got a tensor of {tensor.numel()}"
            )
        self._buffer = tensor

    def index(self) -> BucketKey:
        """A stable id: the indices of the bucket's parameters in ``model.parameters()``,
        in canonical order.

        Unlike ``GradBucket.index()``, it does not change when DDP rebuilds its buckets: once
        the hook's state holds a key for these parameters, they always get that key. It is a
        tuple, not an ``int``.
        """
        return self._key

    def is_last(self) -> bool:
        """Whether this is the step's last bucket (PowerSGD counts steps on it)."""
        return self._is_last

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in canonical order."""
        return list(self._parameters)

    def gradients(self) -> list[torch.Tensor]:
        """Per-parameter gradients: views into :meth:`buffer`, in canonical order."""
        if self._views is not None:
            return list(self._views)
        views = []
        offset = 0
        for shape in self._shapes:
            numel = math.prod(shape)
            views.append(self._buffer.narrow(0, offset, numel).view(shape))
            offset += numel
        return views

    def __repr__(self) -> str:
        return f"CanonicalBucket(index={self._key}, numel={self._buffer.numel()})"


def canonical_bucket_hook(
    hook: HookFn,
    param_order: Iterable[torch.Tensor],
    *,
    state_buckets: Callable[[Any], Iterable[Any]] | None = None,
) -> HookFn:
    """Run ``hook`` on a layout-independent view of each DDP gradient bucket.

    DDP lays a bucket's gradients out in its own order and numbers its buckets, and it
    rebuilds its buckets after the first step, in the order gradients became ready. A hook
    whose state is keyed by ``bucket.index()`` and laid out like ``bucket.buffer()`` (PowerSGD's
    error feedback and warm-start P/Q memories) therefore sees a different layout in a freshly
    built DDP than in the process that saved its state, and a resumed run diverges from an
    uninterrupted one.

    The returned hook hands ``hook`` a :class:`CanonicalBucket` instead: its ``buffer()`` is
    the bucket's per-parameter gradients concatenated in canonical order, ``gradients()`` are
    views into that buffer and ``parameters()`` follow the same order, ``index()`` is the tuple
    of the parameters' indices in ``param_order`` (normally ``model.parameters()``, matched by
    identity) in that order, ``is_last()`` is the bucket's, and ``set_buffer()`` replaces the
    canonical buffer. The canonical order is, with ``state_buckets``, the order of the key the
    state already holds for the same parameters, or else DDP's current order (which the state
    then records, so that on DDP's own layout ``hook`` computes bitwise what it computes
    unwrapped: torch's PowerSGD draws its first ``Q`` per bucket in bucket order); without
    ``state_buckets``, the order of ``param_order`` (the same key for the same parameters
    whatever the layout). When ``hook``'s future completes, its result (canonical order) is copied
    back into the real bucket's gradient views and the real ``bucket.buffer()`` is returned,
    as DDP expects. This is correct with ``gradient_as_bucket_view`` either way, since DDP's
    ``GradBucket.gradients()`` are always views into its buffer.

    With ``state_buckets`` (e.g.
    :func:`~kwplug.plugins.ddp_comm_hooks.power_sgd_state_buckets`), the keys found in the
    state also tell how parameters were grouped before: when a real bucket is exactly tiled by
    several such keys (a resumed run's first step, where DDP still has its initial single
    bucket and the saved state one entry per rebuilt bucket), ``hook`` runs once per tile, so
    the state is applied to the same parameter groups as in the saving process. A state with
    a ``kwplug_bucket_layout`` attribute (kwplug's PowerSGD state) also gets each step's
    canonical keys recorded there, in the order ``hook`` ran them; a layout found there that
    this hook did not record (saved with the state and restored) is looked at first: it cuts
    a resumed run's first buckets, in the saving run's order, even when the state holds no
    key (saved before compression started, or with neither error feedback nor warm start).

    Cost per step and bucket: when the bucket's gradients already lie in canonical order (with
    ``state_buckets``, every step of an uninterrupted run) nothing is copied; otherwise (a
    resumed run's steps before DDP rebuilds its buckets; without ``state_buckets``, DDP's
    rebuilt layout, which typically reverses the order) one gather copy of the bucket into a
    canonical buffer and one scatter copy back, i.e. about two extra reads and writes of the
    bucket's memory, plus some Python work per parameter; the canonical buffer is allocated
    once per layout and reused.

    Args:
        hook: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``.
        param_order: the parameters, in the order that numbers them (normally
            ``model.parameters()``); captured (by identity) now.
        state_buckets: optional ``state -> keys`` giving the bucket keys held in the hook's
            state; only tuples of ints are used.

    Returns:
        A hook DDP accepts; its ``__name__`` and ``__qualname__`` are ``hook``'s, so DDP's logs
        still name the hook that does the work.

    Raises:
        TypeError: ``hook`` is not callable.
    """
    if not callable(hook):
        raise TypeError(f"canonical_bucket_hook wraps a callable hook(state, bucket), got {hook!r}")
    order = {id(p): i for i, p in enumerate(param_order)}
    in_place = bool(getattr(hook, IN_PLACE_VIEWS, False))
    plans: dict[tuple[Any, ...], Plan] = {}
    recorder = LayoutRecorder() if state_buckets is not None else None
    # Per (plan, group): the canonical buffer a copied group is gathered into, reused every
    # step (a fresh bucket-sized tensor per step costs page faults). DDP waits for every
    # bucket's future before the next step, so no step reuses one still in use.
    scratch: dict[tuple[int, int], torch.Tensor] = {}

    def canonical_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        params = bucket.parameters()
        known = known_keys(state, state_buckets)
        layout = recorder.loaded(state) if recorder is not None else ()
        signature = (bucket.index(), buffer.numel(), tuple(map(id, params)), layout, known)
        plan = plans.get(signature)
        if plan is None:
            if len(plans) >= 64:
                plans.clear()
                scratch.clear()
            plan = plans[signature] = make_plan(
                bucket, order, layout, known, layout_order=recorder is not None
            )
        if recorder is not None:
            recorder.record(state, bucket, plan)
        last = bucket.is_last()
        if in_place and plan.dense and len(plan.groups) == 1:
            return _in_place(hook, state, bucket, plan.groups[0], last)
        views: list[torch.Tensor] = []
        futures: list[torch.futures.Future[Any]] = []
        for n, group in enumerate(plan.groups):
            if group.start is not None:
                view = buffer.narrow(0, group.start, group.numel)
            else:
                out = scratch.get((id(plan), n))
                if out is None or out.dtype != buffer.dtype or out.device != buffer.device:
                    out = scratch[id(plan), n] = buffer.new_empty(group.numel)
                view = torch.cat(
                    [
                        buffer.narrow(0, offset, numel)
                        for offset, numel in zip(group.offsets, group.numels, strict=True)
                    ],
                    out=out,
                )
            proxy = CanonicalBucket(
                view,
                group.key,
                last and n == len(plan.groups) - 1,
                [params[pos] for pos in group.positions],
                list(group.shapes),
            )
            views.append(view)
            futures.append(hook(state, cast("GradBucket", proxy)))

        def scatter(results: list[torch.Tensor]) -> torch.Tensor:
            for group, view, result in zip(plan.groups, views, results, strict=True):
                if group.start is not None:
                    if not _same_memory(result, view):
                        view.copy_(result)
                    continue
                if plan.dense and len(plan.groups) == 1 and result.dtype == buffer.dtype:
                    pieces: list[torch.Tensor] = [result] * len(group.positions)
                    starts = itertools.accumulate(group.numels, initial=0)
                    for pos, start, numel in zip(
                        group.positions, starts, group.numels, strict=False
                    ):
                        pieces[pos] = result.narrow(0, start, numel)
                    torch.cat(pieces, out=buffer)  # one kernel: gradients back in DDP's order
                    continue
                start = 0
                for offset, numel in zip(group.offsets, group.numels, strict=True):
                    buffer.narrow(0, offset, numel).copy_(result.narrow(0, start, numel))
                    start += numel
            return buffer

        if len(futures) == 1:
            return futures[0].then(lambda fut: scatter([future_tensor(fut)]))
        return torch.futures.collect_all(futures).then(
            lambda fut: scatter([future_tensor(f) for f in fut.value()])
        )

    canonical_hook.__name__ = getattr(hook, "__name__", None) or "canonical_bucket_hook"
    canonical_hook.__qualname__ = describe(hook)
    canonical_hook.__doc__ = f"{describe(hook)} on canonical bucket views (kwplug)."
    return canonical_hook


def _in_place(
    hook: HookFn, state: Any, bucket: GradBucket, group: Group, last: bool
) -> torch.futures.Future[torch.Tensor]:
    # One canonical bucket covering the whole real one: the real buffer, the gradients as
    # views into it in canonical order; the hook updates them in place.
    buffer = bucket.buffer()
    params = bucket.parameters()
    views = [
        buffer.narrow(0, offset, numel).view(shape)
        for offset, numel, shape in zip(group.offsets, group.numels, group.shapes, strict=True)
    ]
    proxy = CanonicalBucket(
        buffer,
        group.key,
        last,
        [params[pos] for pos in group.positions],
        list(group.shapes),
        views,
    )

    def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
        future_tensor(fut)  # raises the hook's error, if any
        return buffer

    return hook(state, cast("GradBucket", proxy)).then(done)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.numel() == b.numel()
        and a.is_contiguous()
        and b.is_contiguous()
    )

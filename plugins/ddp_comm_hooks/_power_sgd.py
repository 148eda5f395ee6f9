"""PowerSGD: the hooks' state factory, its option schema, and kwplug's batched PowerSGD hook.

``"power_sgd"`` is torch's ``powerSGD_hook``. ``"batched_power_sgd"`` is kwplug's own
:func:`batched_power_sgd_hook`: torch's ``batched_powerSGD_hook`` fails with an
``AssertionError`` at its first compressed step on recent torch (it orthogonalizes 2-D matrices
with a helper that now requires a 3-D batch). Both keep ``PowerSGDState`` as their state, whose
``state_dict``/``load_state_dict`` make a resumed run exact (with the canonical bucket layout).
"""

import inspect
import math
from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from kwplug.plugins.ddp_comm_hooks._adapters import ORDERS_COLLECTIVES
from kwplug.plugins.ddp_comm_hooks._bucket_plan import BucketLayout
from kwplug.plugins.ddp_comm_hooks._common import (
    GradBucket,
    all_reduce_async,
    future_tensor,
    world_size,
)
from kwplug.validators import OptionSchema, number, strict_bool

#: Keyword arguments ``PowerSGDState`` accepts besides ``process_group`` (read from its
#: signature, so a torch release adding an option is supported without a kwplug change).
POWER_SGD_OPTIONS: tuple[str, ...] = tuple(
    name for name in inspect.signature(PowerSGDState).parameters if name != "process_group"
)

_COUNT = number(integer=True, ge=1)
_RATE = number(ge=0, finite=False)


def _check_start_iter(options: Mapping[str, Any]) -> None:
    # PowerSGDState itself refuses this, but only when prepare() builds the state; refusing it
    # here makes the mistake surface at DistributedDataParallelKwargs(...) instead.
    start = options.get("start_powerSGD_iter", 1000)  # PowerSGDState's defaults
    feedback = options.get("use_error_feedback", True)
    warm = options.get("warm_start", True)
    if start <= 1 and (feedback or warm):
        enabled = " and ".join(
            name for name, on in (("use_error_feedback", feedback), ("warm_start", warm)) if on
        )
        raise ValueError(
            f"comm_state_option['start_powerSGD_iter'] must be > 1 when {enabled} is on "
            f"(PowerSGDState requires it; both default to True), got {start}; set "
            "start_powerSGD_iter >= 2, or turn use_error_feedback and warm_start off"
        )


#: What each PowerSGD option accepts (``comm_state_option``); an option only in
#: :data:`POWER_SGD_OPTIONS` (a newer torch) is passed on unchecked. A rank of 0 would silently
#: zero every gradient.
POWER_SGD_SCHEMA = OptionSchema(
    {
        "matrix_approximation_rank": _COUNT,
        "start_powerSGD_iter": _COUNT,
        "min_compression_rate": _RATE,
        "use_error_feedback": strict_bool,
        "warm_start": strict_bool,
        "orthogonalization_epsilon": _RATE,
        "random_seed": number(integer=True, ge=0),
        "compression_stats_logging_frequency": _COUNT,
        "batch_tensors_with_same_shape": strict_bool,
    },
    name="comm_state_option",
    accepted=POWER_SGD_OPTIONS,
    unknown="unknown PowerSGD option(s) {names} in {name}; PowerSGDState accepts: {accepted}",
    accepted_item="{key}",
    relations=(_check_start_iter,),
)


def _count_step(state: PowerSGDState, bucket: GradBucket) -> None:
    # PowerSGDState.maybe_increase_iter (untyped in torch): one step per last bucket.
    cast(Any, state).maybe_increase_iter(bucket)


class _OrderedPowerSGDState(PowerSGDState):
    """``PowerSGDState`` plus a second gloo group on which :func:`batched_power_sgd_hook`
    all-reduces ``Q``, so that its collectives keep one order on every rank without waiting
    inside DDP's autograd callback (see :func:`make_power_sgd_state`), and on which every other
    bucket of torch's per-tensor ``powerSGD_hook`` runs (:meth:`kwplug_lanes`). Saved and
    restored as ``PowerSGDState`` (the groups and the ordering future are never saved), plus
    the canonical bucket layout (``kwplug_bucket_layout``, see
    :data:`~kwplug.plugins.ddp_comm_hooks._bucket_plan.BUCKET_LAYOUT`), which
    :func:`~kwplug.plugins.ddp_comm_hooks.power_sgd_state_dict` saves beside the slots."""

    __slots__ = ("kwplug_bucket_layout", "q_issued", "q_process_group")
    kwplug_bucket_layout: BucketLayout | None
    q_issued: torch.futures.Future[None] | None
    q_process_group: dist.ProcessGroup | None

    def __getstate__(self) -> dict[str, Any]:
        # PowerSGDState.__getstate__ reads self.__slots__, which here names only ours.
        return {s: getattr(self, s) for s in PowerSGDState.__slots__ if s != "process_group"}

    def kwplug_lanes(self) -> tuple[Any, ...]:
        """The lanes :func:`~kwplug.plugins.ddp_comm_hooks.ordered_hook` runs torch's
        per-tensor ``powerSGD_hook`` on: this state, and a view of it whose collectives go
        over the second gloo group, when there is one and ``warm_start`` is on (without warm
        start torch's hook clears every bucket's P and Q memories at each bucket's end, which
        must not overlap another bucket)."""
        group = self.q_process_group
        if group is None or not self.warm_start:
            return (self,)
        return (self, _LaneState(self, group))


class _LaneState:
    """``state`` seen through another process group: every attribute but ``process_group`` is
    read from and written to ``state`` (torch's ``powerSGD_hook`` updates its memories,
    counters and step through the object it is given)."""

    __slots__ = ("_state", "process_group")
    _state: PowerSGDState
    process_group: dist.ProcessGroup

    def __init__(self, state: PowerSGDState, group: dist.ProcessGroup) -> None:
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "process_group", group)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._state, name, value)


def _q_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    # A second gloo group (gloo, several ranks): batched PowerSGD all-reduces Q on it, and
    # per-tensor PowerSGD runs every other bucket on it. Creating a group is collective: this runs
    # in make_power_sgd_state, which kwplug calls in wrap_model on every rank, in step.
    if not dist.is_initialized() or dist.get_world_size(process_group) < 2:
        return None
    if dist.get_backend(process_group) != "gloo":
        return None
    ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
    group: dist.ProcessGroup | None = dist.new_group(ranks=ranks, backend="gloo")
    return group


def make_power_sgd_state(
    process_group: dist.ProcessGroup | None, options: Mapping[str, Any]
) -> PowerSGDState:
    """Build the state of the ``"power_sgd"`` and ``"batched_power_sgd"`` hooks.

    Returns a ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState(
    process_group=process_group, **options)`` (a subclass that, on gloo with several ranks,
    also holds a second gloo group for :func:`batched_power_sgd_hook`'s ``Q`` all-reduces and
    every other bucket of torch's per-tensor hook with warm start; created here, so every rank
    must call this at the same point, as ``wrap_model`` does).
    Its defaults apply to omitted options:
    ``matrix_approximation_rank=1``, ``start_powerSGD_iter=1000`` (steps of plain all-reduce
    before compression starts; must be > 1 with error feedback or warm start),
    ``min_compression_rate=2``, ``use_error_feedback=True``, ``warm_start=True``,
    ``orthogonalization_epsilon=0``, ``random_seed=0``,
    ``compression_stats_logging_frequency=10000``, ``batch_tensors_with_same_shape=False``.

    Args:
        process_group: ``torch.distributed.ProcessGroup`` or ``None`` (the default group).
        options: ``DistributedDataParallelKwargs.comm_state_option``, keyword arguments of
            ``PowerSGDState`` (see :data:`POWER_SGD_OPTIONS`).

    Raises:
        ValueError: an option name ``PowerSGDState`` does not accept (the message lists the
            accepted names), or a value ``PowerSGDState`` rejects (e.g.
            ``start_powerSGD_iter <= 1`` with error feedback).
    """
    check_power_sgd_options(options)
    state = _OrderedPowerSGDState(process_group=process_group, **dict(options))
    state.q_process_group = _q_group(process_group)
    state.q_issued = None
    state.kwplug_bucket_layout = None
    return state


def check_power_sgd_options(options: Mapping[str, Any]) -> None:
    """Check ``comm_state_option`` for the PowerSGD hooks before any training step.

    Args:
        options: keyword arguments of ``PowerSGDState`` (see :data:`POWER_SGD_SCHEMA`).

    Raises:
        ValueError: an unknown key (the message lists the accepted ones), or a value out of
            range (``matrix_approximation_rank``, ``start_powerSGD_iter`` and
            ``compression_stats_logging_frequency`` >= 1; ``min_compression_rate``,
            ``orthogonalization_epsilon`` and ``random_seed`` >= 0), or
            ``start_powerSGD_iter <= 1`` while ``use_error_feedback`` or ``warm_start`` is on
            (both default to true).
        TypeError: a value of the wrong type (``bool`` is not a number here).
    """
    POWER_SGD_SCHEMA.check(options)


def _orthonormalize_columns(batch: torch.Tensor, epsilon: float = 0.0) -> None:
    """Make the columns of each matrix in ``batch`` (shape ``(b, rows, cols)``, ``cols <=
    rows``) orthonormal, in place, by modified Gram-Schmidt.

    A column that is all zeros stays zero instead of becoming NaN.
    """
    if batch.dim() != 3 or batch.shape[2] > batch.shape[1]:
        raise ValueError(
            f"expected a (batch, rows, cols) tensor with cols <= rows, got {tuple(batch.shape)}"
        )
    tiny = torch.finfo(batch.dtype).tiny
    num_cols = batch.shape[2]
    for j in range(num_cols):
        column = batch[:, :, j : j + 1]
        norm = torch.linalg.vector_norm(column, dim=1, keepdim=True)
        column.div_(norm.add_(epsilon).clamp_min_(tiny))
        if j + 1 < num_cols:
            rest = batch[:, :, j + 1 :]
            rest.sub_(column * (column * rest).sum(dim=1, keepdim=True))


def _seeded_normal(rows: int, cols: int, state: PowerSGDState, like: torch.Tensor) -> torch.Tensor:
    # Every replica draws the same seed from the state's RNG (same random_seed, same number
    # of draws), so the random projection is identical across ranks without communication.
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(state.rng.randint(1_000_000_000)))
    sample = torch.randn(rows, cols, generator=generator, dtype=torch.float32)
    return sample.to(device=like.device, dtype=like.dtype)


def batched_power_sgd_hook(
    state: PowerSGDState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD over the whole bucket viewed as one square matrix (Vogels et al., 2019).

    kwplug's own implementation of the algorithm of torch's ``batched_powerSGD_hook``
    (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``), which fails with an
    ``AssertionError`` at its first compressed step on torch 2.13. For the first
    ``state.start_powerSGD_iter`` steps the bucket is averaged by a plain all-reduce. Then, per
    step and bucket: the flattened bucket (plus the local error of the previous step when
    ``use_error_feedback``) is zero-padded to an ``n x n`` matrix ``M``, with ``n =
    ceil(sqrt(numel))``; with ``Q`` (``n x r``, ``r = matrix_approximation_rank``, random with
    a seed shared by all ranks, or last step's ``Q`` when ``warm_start``) orthonormalized,
    ``P = M Q`` is all-reduced and orthonormalized, ``Q = M^T P`` is all-reduced and divided by
    the world size, and the bucket becomes ``P Q^T`` (cut back to ``numel``). Two all-reduces
    of ``n * r`` elements replace one of ``numel``. Orthonormalization works on a 3-D
    ``(1, n, r)`` view, by Gram-Schmidt.

    Compared with ``"power_sgd"`` (per-tensor compression), it compresses more aggressively
    and is faster to compute, at a larger accuracy cost.

    Args:
        state: a ``PowerSGDState`` (see :func:`make_power_sgd_state`); its
            ``matrix_approximation_rank``, ``start_powerSGD_iter``, ``use_error_feedback``,
            ``warm_start``, ``orthogonalization_epsilon`` and ``random_seed`` apply;
            ``min_compression_rate`` and ``batch_tensors_with_same_shape`` do not.
        bucket: the ``torch.distributed.GradBucket`` DDP hands to the hook.

    Returns:
        A future of the bucket buffer holding the (approximately) averaged gradients.
    """
    group_size = world_size(state.process_group)
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        _count_step(state, bucket)
        buffer.div_(group_size)
        return all_reduce_async(buffer, state.process_group).then(future_tensor)

    numel = buffer.numel()
    side = max(1, math.isqrt(max(numel - 1, 0)) + 1)  # ceil(sqrt(numel))
    rank = max(1, min(int(state.matrix_approximation_rank), side))
    key = bucket.index()
    state.total_numel_before_compression += numel
    state.total_numel_after_compression += 2 * side * rank

    # With error feedback, last step's error tensor (padding included) becomes this step's
    # matrix, then this step's error, in place: no bucket-sized allocation per step.
    error = state.error_dict.get(key) if state.use_error_feedback else None
    if error is not None and error.shape == (side * side,) and error.dtype == buffer.dtype:
        flat = error
        flat[:numel].add_(buffer)
    else:
        flat = buffer.new_zeros(side * side)
        flat[:numel].copy_(buffer)
    matrix = flat.view(side, side)

    p_mat = state.p_memory_dict.get(key) if state.warm_start else None
    q_mat = state.q_memory_dict.get(key) if state.warm_start else None
    if p_mat is None or q_mat is None or q_mat.shape != (side, rank) or q_mat.dtype != flat.dtype:
        q_mat = _seeded_normal(side, rank, state, flat)
        p_mat = flat.new_empty(side, rank)
    epsilon = float(state.orthogonalization_epsilon)
    _orthonormalize_columns(q_mat.unsqueeze(0), epsilon)
    torch.matmul(matrix, q_mat, out=p_mat)
    p_future = all_reduce_async(p_mat, state.process_group)
    q_group = getattr(state, "q_process_group", None)
    # Q all-reduces go over their own group, each issued after the previous bucket's (a
    # chain of futures set in bucket order on this thread), so their order is the same on
    # every rank while P all-reduces keep the hook's order on the main group.
    previous: torch.futures.Future[Any] | None = getattr(state, "q_issued", None)
    issued: torch.futures.Future[None] = torch.futures.Future()
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    if q_group is not None:
        state.q_issued = issued  # type: ignore[attr-defined]

    def decompress(fut: torch.futures.Future[Any]) -> None:
        try:
            q_mean = future_tensor(fut).div_(group_size)
            # The bucket is P Q^T cut to numel: the rows wholly inside it are computed straight
            # into the buffer, the last one or two (cut, then padding) on their own.
            whole = numel // side
            out = buffer.view(-1)
            torch.matmul(p_mat[:whole], q_mean.t(), out=out[: whole * side].view(whole, side))
            tail = torch.matmul(p_mat[whole:], q_mean.t()).view(-1)
            out[whole * side :].copy_(tail[: numel - whole * side])
            if state.use_error_feedback:
                # The residual: what this rank wanted to send minus what the bucket became.
                flat[:numel].sub_(out)
                flat[numel:].sub_(tail[numel - whole * side :])
                state.error_dict[key] = flat
            if state.warm_start:
                state.p_memory_dict[key] = p_mat
                state.q_memory_dict[key] = q_mean
            _count_step(state, bucket)
        except BaseException as error:  # handed to DDP through the future
            result.set_exception(error)  # type: ignore[arg-type]  # torch's stub is too narrow
            return
        result.set_result(buffer)

    def reduce_q(fut: torch.futures.Future[Any]) -> None:
        try:
            p_sum = future_tensor(fut)  # p_mat itself, summed over ranks
            _orthonormalize_columns(p_sum.unsqueeze(0), epsilon)
            torch.matmul(matrix.t(), p_sum, out=q_mat)
            # Looked up, not captured: a callback never holds the last reference to a group.
            group = getattr(state, "q_process_group", None)
            q_future = all_reduce_async(q_mat, state.process_group if group is None else group)
        except BaseException as error:  # handed to DDP through the future
            issued.set_result(None)
            result.set_exception(error)  # type: ignore[arg-type]  # torch's stub is too narrow
            return
        issued.set_result(None)
        q_future.then(decompress)

    return _chain_q(previous, p_future, reduce_q, result, q_group)


def _chain_q(
    previous: torch.futures.Future[Any] | None,
    p_future: torch.futures.Future[Any],
    reduce_q: Any,
    result: torch.futures.Future[Any],
    q_group: dist.ProcessGroup | None,
) -> torch.futures.Future[Any]:
    # Calls reduce_q(P's future) once P is summed and the previous bucket's Q all-reduce is
    # issued (gloo runs a group's collectives in issue order); with one group, waits for this
    # bucket to finish before the next bucket's collectives. Returns ``result``.
    if previous is None or previous.done():
        p_future.then(reduce_q)
    else:
        # Both done: then P's result is ready and the previous Q is issued.
        torch.futures.collect_all([previous, p_future]).then(lambda both: reduce_q(both.value()[1]))
    if q_group is None:
        result.wait()  # one group: finish before the next bucket's collectives (gloo order)
    return result


# Orders its collectives itself (a second group for Q, or waiting when there is none).
setattr(batched_power_sgd_hook, ORDERS_COLLECTIVES, True)


def power_sgd_state_buckets(state: Any) -> list[Any]:
    """The bucket keys a ``PowerSGDState`` holds (error feedback and P/Q memories).

    Given to :func:`~kwplug.plugins.ddp_comm_hooks.canonical_bucket_hook` as
    ``state_buckets`` for the PowerSGD hooks: the keys record how the parameters were grouped
    into buckets when the state was built, so a resumed run whose DDP still has its initial
    bucket layout can split its buckets the same way.
    """
    keys: dict[Any, None] = {}
    for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
        keys.update(dict.fromkeys(getattr(state, name, None) or ()))
    return list(keys)

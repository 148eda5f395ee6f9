"""kwplug's built-in DDP communication hooks, contributed through the ``comm_hooks`` hook.

This module is itself a plugin object (entry point ``ddp_comm_hooks`` of the
``kwplug.handlers`` group): its module-level :func:`comm_hooks` implementation gives the named
hooks ``"fp16"``, ``"bf16"``, ``"power_sgd"`` and ``"batched_power_sgd"`` (source ``"kwplug"``)
once per Accelerator, whatever handlers are registered. It also holds the compression wrappers
used by ``DistributedDataParallelKwargs(comm_wrapper=...)``, and :func:`canonical_bucket_hook`,
through which the PowerSGD hooks are registered so that their state does not depend on DDP's
bucket layout (bitwise-exact resume from a checkpoint).

Every hook follows PyTorch's contract for
``torch.nn.parallel.DistributedDataParallel.register_comm_hook``:
``hook(state, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]``,
where the future's tensor is the *averaged* gradient bucket (same shape as
``bucket.buffer()``).

Why kwplug has its own hooks rather than re-exporting
``torch.distributed.algorithms.ddp_comm_hooks``:

- ``DistributedDataParallel`` refuses any hook *named* ``bf16_compress_hook`` or
  ``bf16_compress_wrapper_hook`` unless CUDA with NCCL >= 2.10 (or XPU with XCCL) is present,
  although gloo all-reduces ``torch.bfloat16`` tensors fine. kwplug's hooks have other names
  and train on CPU/gloo.
- ``batched_powerSGD_hook`` fails with an ``AssertionError`` at its first compressed step on
  recent torch (it orthogonalizes 2-D matrices with a helper that now requires a 3-D batch).
  :func:`batched_power_sgd_hook` is an independent implementation that keeps using
  ``PowerSGDState`` as its state.

Note: this module deliberately does not use ``from __future__ import annotations``. DDP
compares the ``bucket`` and return annotations of a hook with ``torch.distributed.GradBucket``
and ``torch.futures.Future[torch.Tensor]`` *objects*; string annotations would be rejected.
"""

import inspect
import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

import attrs
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    batched_powerSGD_hook,
    powerSGD_hook,
)

from kwplug.comm_hooks import CommHook, HookFn
from kwplug.hookspecs import hookimpl

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket
else:
    # The very object DDP compares hook annotations with (torch.distributed.GradBucket).
    GradBucket = dist.GradBucket

__all__ = [
    "BUILTIN_HOOK_NAMES",
    "COMPRESSION_WRAPPERS",
    "LAYOUT_DEPENDENT_HOOKS",
    "POWER_SGD_OPTIONS",
    "BucketKey",
    "CanonicalBucket",
    "batched_power_sgd_hook",
    "bf16_compress_allreduce_hook",
    "bf16_compress_wrapper",
    "builtin_comm_hooks",
    "canonical_bucket_hook",
    "check_power_sgd_options",
    "comm_hooks",
    "ddp_compatible_hook",
    "fp16_compress_allreduce_hook",
    "fp16_compress_wrapper",
    "make_power_sgd_state",
    "mean_allreduce_hook",
    "power_sgd_state_buckets",
]

#: Source recorded in the :class:`~kwplug.CommHook` records of this module.
SOURCE = "kwplug"

#: Names of the hooks :func:`comm_hooks` contributes, in a stable order.
BUILTIN_HOOK_NAMES: tuple[str, ...] = ("fp16", "bf16", "power_sgd", "batched_power_sgd")

#: Keyword arguments ``PowerSGDState`` accepts besides ``process_group`` (read from its
#: signature, so a torch release adding an option is supported without a kwplug change).
POWER_SGD_OPTIONS: tuple[str, ...] = tuple(
    name for name in inspect.signature(PowerSGDState).parameters if name != "process_group"
)

# -- helpers --------------------------------------------------------------------------------


def _world_size(process_group: dist.ProcessGroup | None) -> int:
    # ``group=None`` means the default group for every torch.distributed call. Callbacks below
    # never capture a ProcessGroup: a callback released on the backend's worker thread after
    # destroy_process_group() would drop the last reference there, and the group's destructor
    # would join that very thread (std::system_error "Resource deadlock avoided").
    return dist.get_world_size(process_group)


def _describe(hook: Any) -> str:
    # A readable name for DDP's logs and kwplug's messages, for functions, partials and objects.
    func = getattr(hook, "func", None)
    if func is not None and not isinstance(getattr(hook, "__qualname__", None), str):
        return f"partial({_describe(func)})"
    name = getattr(hook, "__qualname__", None)
    return name if isinstance(name, str) else type(hook).__qualname__


def _all_reduce_async(
    tensor: torch.Tensor, process_group: dist.ProcessGroup | None
) -> torch.futures.Future[list[torch.Tensor]]:
    # Sum over the group (``None`` = default group) in place; the future holds [tensor].
    work = dist.all_reduce(tensor, group=process_group, async_op=True)
    if work is None:  # only when this rank is not in the group
        raise RuntimeError("this process is not a member of the hook's process group")
    return cast("torch.futures.Future[list[torch.Tensor]]", work.get_future())


def _count_step(state: PowerSGDState, bucket: GradBucket) -> None:
    # PowerSGDState.maybe_increase_iter (untyped in torch): one step per last bucket.
    cast(Any, state).maybe_increase_iter(bucket)


def _future_tensor(fut: torch.futures.Future[Any]) -> torch.Tensor:
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


# -- plain and low-precision all-reduce -----------------------------------------------------


def mean_allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the gradient bucket over the group with one asynchronous all-reduce.

    This is what DDP does without a hook; kwplug uses it as the inner hook when
    ``comm_wrapper`` is set but ``comm_hook`` is ``"no"``.

    Args:
        process_group: ``torch.distributed.ProcessGroup`` to reduce over; ``None`` = the
            default (world) group.
        bucket: the ``torch.distributed.GradBucket`` DDP hands to the hook.

    Returns:
        A future of the bucket buffer, divided by the world size and summed in place.
    """
    buffer = bucket.buffer()
    buffer.div_(_world_size(process_group))
    return _all_reduce_async(buffer, process_group).then(_future_tensor)


def _low_precision_allreduce(
    process_group: dist.ProcessGroup | None, bucket: GradBucket, dtype: torch.dtype
) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    # Divide in the bucket's own precision before the cast: a float16 sum of world_size
    # gradients near the float16 maximum would otherwise overflow.
    compressed = torch.div(buffer, _world_size(process_group)).to(dtype)

    def decompress(fut: torch.futures.Future[Any]) -> torch.Tensor:
        buffer.copy_(_future_tensor(fut))
        return buffer

    return _all_reduce_async(compressed, process_group).then(decompress)


def fp16_compress_allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with an all-reduce in ``torch.float16`` (half the traffic of fp32).

    The bucket buffer is divided by the world size, cast to float16, all-reduced
    asynchronously, and the result is cast back into the buffer's own dtype in place. Same
    algorithm as ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.
    fp16_compress_hook``; works with every backend that all-reduces float16 (gloo, nccl).

    Args:
        process_group: ``torch.distributed.ProcessGroup`` or ``None`` (default group); the
            hook's state, so ``DistributedDataParallelKwargs.comm_state_option`` must be empty.
        bucket: the ``torch.distributed.GradBucket`` DDP hands to the hook.

    Returns:
        A future of the averaged bucket buffer (original dtype, float16 precision).
    """
    return _low_precision_allreduce(process_group, bucket, torch.float16)


def bf16_compress_allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with an all-reduce in ``torch.bfloat16``.

    Like :func:`fp16_compress_allreduce_hook` with bfloat16 (float32's range, 8 bits of
    mantissa). Unlike torch's ``bf16_compress_hook``, which ``DistributedDataParallel``
    rejects (``TypeError``) unless CUDA+NCCL or XPU+XCCL is present, it runs on any backend
    that all-reduces bfloat16, including gloo on CPU.

    Args:
        process_group: ``torch.distributed.ProcessGroup`` or ``None`` (default group).
        bucket: the ``torch.distributed.GradBucket`` DDP hands to the hook.

    Returns:
        A future of the averaged bucket buffer (original dtype, bfloat16 precision).
    """
    return _low_precision_allreduce(process_group, bucket, torch.bfloat16)


# -- compression wrappers -------------------------------------------------------------------


def _compress_wrapper(hook: HookFn, dtype: torch.dtype, label: str) -> HookFn:
    if not callable(hook):
        raise TypeError(f"{label} wraps a callable hook(state, bucket), got {hook!r}")

    def wrapped(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        full = bucket.buffer()
        bucket.set_buffer(full.to(dtype))
        inner_future = hook(state, bucket)

        def decompress(fut: torch.futures.Future[Any]) -> torch.Tensor:
            full.copy_(_future_tensor(fut))
            return full

        return inner_future.then(decompress)

    inner_name = _describe(hook)
    # Not torch's "bf16_compress_wrapper_hook": DDP rejects that name without CUDA+NCCL.
    wrapped.__name__ = f"kwplug_{label}_hook"
    wrapped.__qualname__ = f"kwplug_{label}_hook[{inner_name}]"
    wrapped.__doc__ = f"{hook!r} run on a {dtype} copy of the bucket (kwplug {label})."
    return wrapped


def fp16_compress_wrapper(hook: HookFn) -> HookFn:
    """Run ``hook`` on a ``torch.float16`` copy of the bucket, then cast the result back.

    The returned hook casts ``bucket.buffer()`` to float16 and installs the copy with
    ``bucket.set_buffer``, calls ``hook(state, bucket)`` (so e.g. PowerSGD compresses and
    all-reduces float16 matrices), and copies the future's result into the original buffer
    in its own dtype. Maps to ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.
    fp16_compress_wrapper``.

    Args:
        hook: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``; its state is
            passed through unchanged.

    Returns:
        The wrapped hook, with the same ``(state, bucket)`` signature.

    Raises:
        TypeError: ``hook`` is not callable.
    """
    return _compress_wrapper(hook, torch.float16, "fp16_compress_wrapper")


def bf16_compress_wrapper(hook: HookFn) -> HookFn:
    """Run ``hook`` on a ``torch.bfloat16`` copy of the bucket, then cast the result back.

    Like :func:`fp16_compress_wrapper` with bfloat16. Unlike torch's ``bf16_compress_wrapper``
    (whose result DDP rejects without CUDA+NCCL or XPU+XCCL), it works with gloo on CPU.

    Args:
        hook: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``.

    Returns:
        The wrapped hook.

    Raises:
        TypeError: ``hook`` is not callable.
    """
    return _compress_wrapper(hook, torch.bfloat16, "bf16_compress_wrapper")


#: ``comm_wrapper`` value -> wrapper factory.
COMPRESSION_WRAPPERS: Mapping[str, Callable[[HookFn], HookFn]] = {
    "fp16": fp16_compress_wrapper,
    "bf16": bf16_compress_wrapper,
}


# -- PowerSGD -------------------------------------------------------------------------------


def make_power_sgd_state(
    process_group: dist.ProcessGroup | None, options: Mapping[str, Any]
) -> PowerSGDState:
    """Build the state of the ``"power_sgd"`` and ``"batched_power_sgd"`` hooks.

    Returns ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState(
    process_group=process_group, **options)``. Its defaults apply to omitted options:
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
    return PowerSGDState(process_group=process_group, **dict(options))


#: Accepted values of PowerSGD's options: (kind, lower bound or None). ``"int"`` and
#: ``"number"`` never accept a ``bool``.
_POWER_SGD_VALUES: dict[str, tuple[str, float | None]] = {
    "matrix_approximation_rank": ("int", 1),
    "start_powerSGD_iter": ("int", 1),
    "min_compression_rate": ("number", 0),
    "use_error_feedback": ("bool", None),
    "warm_start": ("bool", None),
    "orthogonalization_epsilon": ("number", 0),
    "random_seed": ("int", 0),
    "compression_stats_logging_frequency": ("int", 1),
    "batch_tensors_with_same_shape": ("bool", None),
}


def check_power_sgd_options(options: Mapping[str, Any]) -> None:
    """Check ``comm_state_option`` for the PowerSGD hooks before any training step.

    Raises:
        ValueError: an unknown key (the message lists the accepted ones), or a value out of
            range (``matrix_approximation_rank``, ``start_powerSGD_iter`` and
            ``compression_stats_logging_frequency`` >= 1; ``min_compression_rate``,
            ``orthogonalization_epsilon`` and ``random_seed`` >= 0) -- a rank of 0 would
            silently zero every gradient.
        TypeError: a value of the wrong type (ints, numbers and bools as above).
    """
    unknown = sorted(set(options) - set(POWER_SGD_OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown PowerSGD option(s) {', '.join(map(repr, unknown))} in comm_state_option; "
            f"PowerSGDState accepts: {', '.join(POWER_SGD_OPTIONS)}"
        )
    for key, value in options.items():
        kind, low = _POWER_SGD_VALUES.get(key, ("any", None))
        place = f"comm_state_option[{key!r}]"
        if kind == "bool" and not isinstance(value, bool):
            raise TypeError(f"{place} must be True or False, got {value!r}")
        if kind in ("int", "number"):
            types = (int,) if kind == "int" else (int, float)
            if isinstance(value, bool) or not isinstance(value, types):
                wanted = "an int" if kind == "int" else "a number"
                raise TypeError(f"{place} must be {wanted}, got {value!r}")
            if low is not None and not value >= low:
                raise ValueError(f"{place} must be >= {low:g}, got {value!r}")


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
    world_size = _world_size(state.process_group)
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        _count_step(state, bucket)
        buffer.div_(world_size)
        return _all_reduce_async(buffer, state.process_group).then(_future_tensor)

    numel = buffer.numel()
    side = max(1, math.isqrt(max(numel - 1, 0)) + 1)  # ceil(sqrt(numel))
    rank = max(1, min(int(state.matrix_approximation_rank), side))
    key = bucket.index()
    state.total_numel_before_compression += numel
    state.total_numel_after_compression += 2 * side * rank

    flat = buffer.new_zeros(side * side)
    flat[:numel].copy_(buffer)
    target: torch.Tensor | None = None
    if state.use_error_feedback:
        error = state.error_dict.get(key)
        if error is not None and error.shape == flat.shape and error.dtype == flat.dtype:
            flat.add_(error)
        target = flat.clone()  # what this rank wants to send; the residual is kept for later
    matrix = flat.view(side, side)

    p_mat = state.p_memory_dict.get(key) if state.warm_start else None
    q_mat = state.q_memory_dict.get(key) if state.warm_start else None
    if p_mat is None or q_mat is None or q_mat.shape != (side, rank) or q_mat.dtype != flat.dtype:
        q_mat = _seeded_normal(side, rank, state, flat)
        p_mat = flat.new_empty(side, rank)
    epsilon = float(state.orthogonalization_epsilon)
    _orthonormalize_columns(q_mat.unsqueeze(0), epsilon)
    torch.matmul(matrix, q_mat, out=p_mat)
    p_future = _all_reduce_async(p_mat, state.process_group)

    def reduce_q(fut: torch.futures.Future[Any]) -> torch.Tensor:
        p_sum = _future_tensor(fut)  # p_mat itself, summed over ranks
        _orthonormalize_columns(p_sum.unsqueeze(0), epsilon)
        torch.matmul(matrix.t(), p_sum, out=q_mat)
        _all_reduce_async(q_mat, state.process_group).wait()
        return q_mat

    def decompress(fut: torch.futures.Future[Any]) -> torch.Tensor:
        q_mean = _future_tensor(fut).div_(world_size)
        torch.matmul(p_mat, q_mean.t(), out=matrix)
        if target is not None:
            state.error_dict[key] = target.sub_(flat)
        if state.warm_start:
            state.p_memory_dict[key] = p_mat
            state.q_memory_dict[key] = q_mean
        buffer.copy_(flat[:numel])
        _count_step(state, bucket)
        return buffer

    return p_future.then(reduce_q).then(decompress)


# -- canonical bucket layout ----------------------------------------------------------------

#: Key of a :class:`CanonicalBucket`: the sorted canonical indices of its parameters.
BucketKey = tuple[int, ...]


class CanonicalBucket:
    """A layout-independent stand-in for a ``torch.distributed.GradBucket``.

    Built by :func:`canonical_bucket_hook` for the hook it wraps. It offers the methods
    PowerSGD, kwplug's hooks and the compression wrappers call on a bucket, with the bucket's
    parameters in their canonical order (their order in ``model.parameters()``) rather than in
    DDP's bucket order, which DDP changes when it rebuilds its buckets after the first step.

    Args:
        buffer: the flat gradients of the parameters, concatenated in canonical order.
        key: what :meth:`index` returns, the sorted canonical indices of the parameters.
        is_last: what :meth:`is_last` returns.
        parameters: the parameters, in canonical order.
        shapes: the gradients' shapes, in canonical order (their sizes add up to the
            buffer's length).
    """

    __slots__ = ("_buffer", "_is_last", "_key", "_parameters", "_shapes")

    def __init__(
        self,
        buffer: torch.Tensor,
        key: BucketKey,
        is_last: bool,
        parameters: list[torch.Tensor],
        shapes: list[torch.Size],
    ) -> None:
        self._buffer = buffer
        self._key = key
        self._is_last = is_last
        self._parameters = parameters
        self._shapes = shapes

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
        """A stable id: the sorted canonical indices of the bucket's parameters.

        Unlike ``GradBucket.index()``, it does not change when DDP rebuilds its buckets, and
        the same parameters always get the same id. It is a tuple, not an ``int``.
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
        views = []
        offset = 0
        for shape in self._shapes:
            numel = math.prod(shape)
            views.append(self._buffer.narrow(0, offset, numel).view(shape))
            offset += numel
        return views

    def __repr__(self) -> str:
        return f"CanonicalBucket(index={self._key}, numel={self._buffer.numel()})"


@attrs.frozen
class _Group:
    # One canonical bucket cut from a real bucket: the real-bucket positions of its
    # parameters in canonical order, their element offsets in the real buffer and sizes.
    key: BucketKey
    positions: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    # When the parameters lie in canonical order, back to back, in the real buffer: the
    # canonical buffer is the slice real[start : start + numel], no copy needed.
    start: int | None

    @property
    def numel(self) -> int:
        return sum(self.numels)


@attrs.frozen
class _Plan:
    groups: tuple[_Group, ...]
    # The real buffer is the real-order gradients back to back, nothing else: the scatter of
    # a single copied group is one torch.cat(..., out=buffer).
    dense: bool


def _known_keys(
    state: Any, state_buckets: Callable[[Any], Iterable[Any]] | None
) -> frozenset[BucketKey]:
    if state_buckets is None:
        return frozenset()
    return frozenset(
        key
        for key in state_buckets(state)
        if isinstance(key, tuple) and all(isinstance(i, int) for i in key)
    )


def _partition(indices: list[int], known: frozenset[BucketKey]) -> list[BucketKey]:
    # The buckets of an earlier layout that exactly tile this bucket, if any (e.g. the first
    # step after a resume, when DDP still has its initial single bucket while the saved state
    # has one entry per rebuilt bucket); else the whole bucket as one.
    whole = tuple(sorted(indices))
    members = set(whole)
    if whole in known:
        return [whole]
    inside = [key for key in known if key and members.issuperset(key)]
    covered = [i for key in inside for i in key]
    if inside and len(covered) == len(members) and set(covered) == members:
        # DDP fills buckets in gradient-ready order, roughly the reverse of the parameters:
        # process the tiles the same way (last = the one with the first parameters).
        return sorted(inside, key=lambda key: key[-1], reverse=True)
    return [whole]


def _make_plan(bucket: GradBucket, order: Mapping[int, int], known: frozenset[BucketKey]) -> _Plan:
    buffer = bucket.buffer()
    base = buffer.storage_offset()
    params = bucket.parameters()
    grads = bucket.gradients()
    offsets = [int(grad.storage_offset()) - int(base) for grad in grads]
    numels = [grad.numel() for grad in grads]
    # A parameter missing from param_order (should not happen) goes after the known ones.
    canonical = [order.get(id(p), len(order) + pos) for pos, p in enumerate(params)]
    position_of = {index: pos for pos, index in enumerate(canonical)}
    groups = []
    for key in _partition(canonical, known):
        positions = tuple(position_of[index] for index in key)
        group_offsets = tuple(offsets[pos] for pos in positions)
        group_numels = tuple(numels[pos] for pos in positions)
        back_to_back = all(
            group_offsets[i + 1] == group_offsets[i] + group_numels[i]
            for i in range(len(positions) - 1)
        )
        groups.append(
            _Group(
                key=key,
                positions=positions,
                offsets=group_offsets,
                numels=group_numels,
                shapes=tuple(grads[pos].shape for pos in positions),
                start=group_offsets[0] if back_to_back else None,
            )
        )
    dense = sum(numels) == buffer.numel() and all(
        offsets[i] == sum(numels[:i]) for i in range(len(offsets))
    )
    return _Plan(groups=tuple(groups), dense=dense)


def power_sgd_state_buckets(state: Any) -> list[Any]:
    """The bucket keys a ``PowerSGDState`` holds (error feedback and P/Q memories).

    Given to :func:`canonical_bucket_hook` as ``state_buckets`` for the PowerSGD hooks: the
    keys record how the parameters were grouped into buckets when the state was built, so a
    resumed run whose DDP still has its initial bucket layout can split its buckets the same
    way.
    """
    keys: dict[Any, None] = {}
    for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
        keys.update(dict.fromkeys(getattr(state, name, None) or ()))
    return list(keys)


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
    the bucket's per-parameter gradients concatenated in canonical order (the order of
    ``param_order``, normally ``model.parameters()``, matched by identity), ``gradients()`` are
    views into that buffer and ``parameters()`` follow the same order, ``index()`` is the
    sorted tuple of the parameters' canonical indices (the same for the same parameters
    whatever DDP's layout), ``is_last()`` is the bucket's, and ``set_buffer()`` replaces the
    canonical buffer. When ``hook``'s future completes, its result (canonical order) is copied
    back into the real bucket's gradient views and the real ``bucket.buffer()`` is returned,
    as DDP expects. This is correct with ``gradient_as_bucket_view`` either way, since DDP's
    ``GradBucket.gradients()`` are always views into its buffer.

    With ``state_buckets`` (e.g. :func:`power_sgd_state_buckets`), the keys found in the
    state also tell how parameters were grouped before: when a real bucket is exactly tiled by
    several such keys (a resumed run's first step, where DDP still has its initial single
    bucket and the saved state one entry per rebuilt bucket), ``hook`` runs once per tile, so
    the state is applied to the same parameter groups as in the saving process.

    Cost per step and bucket: when the bucket's gradients already lie in canonical order (DDP's
    initial layout) nothing is copied; otherwise (after DDP's rebuild, which typically reverses
    the order) one gather copy of the bucket into a new canonical buffer and one scatter copy
    back, i.e. about two extra reads and writes of the bucket's memory and one bucket-sized
    temporary, plus some Python work per parameter.

    Args:
        hook: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``.
        param_order: the parameters, in canonical order; captured (by identity) now.
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
    plans: dict[tuple[Any, ...], _Plan] = {}

    def canonical_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        params = bucket.parameters()
        known = _known_keys(state, state_buckets)
        signature = (bucket.index(), buffer.numel(), tuple(map(id, params)), known)
        plan = plans.get(signature)
        if plan is None:
            if len(plans) >= 64:
                plans.clear()
            plan = plans[signature] = _make_plan(bucket, order, known)
        last = bucket.is_last()
        views: list[torch.Tensor] = []
        futures: list[torch.futures.Future[Any]] = []
        for n, group in enumerate(plan.groups):
            if group.start is not None:
                view = buffer.narrow(0, group.start, group.numel)
            else:
                view = torch.cat(
                    [
                        buffer.narrow(0, offset, numel)
                        for offset, numel in zip(group.offsets, group.numels, strict=True)
                    ]
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
            return futures[0].then(lambda fut: scatter([_future_tensor(fut)]))
        return torch.futures.collect_all(futures).then(
            lambda fut: scatter([_future_tensor(f) for f in fut.value()])
        )

    canonical_hook.__name__ = getattr(hook, "__name__", None) or "canonical_bucket_hook"
    canonical_hook.__qualname__ = _describe(hook)
    canonical_hook.__doc__ = f"{_describe(hook)} on canonical bucket views (kwplug)."
    return canonical_hook


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

    Args:
        hook: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``.

    Returns:
        A hook with the same contract whose future is already done.
    """

    def serial_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        future = hook(state, bucket)
        future.wait()  # raises what the hook's chain raised
        result = _future_tensor(future)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(result)
        return done

    serial_hook.__name__ = getattr(hook, "__name__", None) or "serialized_hook"
    serial_hook.__qualname__ = _describe(hook)
    serial_hook.__doc__ = f"{_describe(hook)}, completed before returning (kwplug, gloo)."
    return serial_hook


#: Hooks whose state depends on DDP's bucket layout; kwplug runs them through
#: :func:`canonical_bucket_hook` (with :func:`power_sgd_state_buckets`).
LAYOUT_DEPENDENT_HOOKS: frozenset[Callable[..., Any]] = frozenset(
    {powerSGD_hook, batched_powerSGD_hook, batched_power_sgd_hook}
)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.numel() == b.numel()
        and a.is_contiguous()
        and b.is_contiguous()
    )


# -- making any callable acceptable to DDP --------------------------------------------------


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

    kwplug_comm_hook.__qualname__ = f"kwplug_comm_hook[{_describe(hook)}]"
    return kwplug_comm_hook


# -- the plugin -----------------------------------------------------------------------------


def builtin_comm_hooks() -> dict[str, CommHook]:
    """kwplug's named hooks, by name (a new dict each call).

    - ``"fp16"``: :func:`fp16_compress_allreduce_hook`, state = process group.
    - ``"bf16"``: :func:`bf16_compress_allreduce_hook`, state = process group.
    - ``"power_sgd"``: torch's ``powerSGD_hook`` (per-tensor PowerSGD), state from
      :func:`make_power_sgd_state`.
    - ``"batched_power_sgd"``: :func:`batched_power_sgd_hook`, state from
      :func:`make_power_sgd_state`.
    """
    return {
        "fp16": CommHook("fp16", fp16_compress_allreduce_hook, source=SOURCE),
        "bf16": CommHook("bf16", bf16_compress_allreduce_hook, source=SOURCE),
        "power_sgd": CommHook("power_sgd", powerSGD_hook, make_power_sgd_state, source=SOURCE),
        "batched_power_sgd": CommHook(
            "batched_power_sgd", batched_power_sgd_hook, make_power_sgd_state, source=SOURCE
        ),
    }


@hookimpl
def comm_hooks() -> Mapping[str, CommHook]:
    """Answer the ``comm_hooks`` hook with :func:`builtin_comm_hooks`.

    A module-level implementation, so that the hooks are contributed exactly once per
    Accelerator (the ``DistributedDataParallelKwargs`` handler may be registered both as the
    default instance and as the user's).
    """
    return builtin_comm_hooks()

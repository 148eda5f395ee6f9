"""kwplug's per-tensor PowerSGD with in-place error feedback: the ``"power_sgd_inplace"`` hook.

The algorithm of torch's ``powerSGD_hook`` (Vogels et al., 2019; each matrix-shaped gradient
compressed on its own, the others all-reduced as they are), with the state of
``PowerSGDState``, rearranged for a slow link and a busy CPU:

- **One collective for the uncompressed tensors and the ``P`` factors** (torch issues the
  ``P`` all-reduce only after the uncompressed tensors' all-reduce completed), then one for
  the ``Q`` factors: two dependent round trips per bucket instead of three.
- **Collectives ordered without waiting**: the first all-reduce is issued by DDP's autograd
  thread in bucket order; the ``Q`` all-reduces go over the state's second gloo group, each
  issued after the previous bucket's (the scheme of kwplug's ``batched_power_sgd_hook``).
  torch's hook waits for its ``Q`` all-reduce inside a callback of gloo's worker thread, and
  on gloo kwplug has to chain its buckets.
- **In-place error feedback**: the error tensor kept per bucket (the compressed matrices back
  to back) becomes this step's ``M`` (``+= gradient``), then the residual ``M - P Q^T``; the
  bucket gets ``P Q^T``. torch clones the whole bucket and allocates ``clone - bucket`` every
  step. Only the compressed matrices carry an error: torch's error for the uncompressed
  tensors (this rank's gradient minus the average) sums to zero over the ranks, so adding it
  changes the average only by rounding.
- **Factors stored transposed** (``r x rows``, ``r x cols``): MKL's products with an ``n x 2``
  operand run 5-25x slower than with a ``2 x n`` one on the CPU.
- **No canonical copies**: kwplug's canonical bucket layout (exact resume) is handed to it as
  views into DDP's buffer (``IN_PLACE_VIEWS``); matrix products only touch the error tensor
  and the factors, whose offsets do not depend on DDP's layout, so a resumed run computes bit
  for bit what an uninterrupted one did.
"""

from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from kwplug.plugins.ddp_comm_hooks._adapters import ORDERS_COLLECTIVES
from kwplug.plugins.ddp_comm_hooks._canonical import IN_PLACE_VIEWS
from kwplug.plugins.ddp_comm_hooks._common import (
    GradBucket,
    all_reduce_async,
    future_tensor,
    world_size,
)
from kwplug.plugins.ddp_comm_hooks._power_sgd import (
    _chain_q,
    _count_step,
    _orthonormalize_columns,
)


class _Layout:
    # Where each gradient of a bucket goes: matrices compressed (their view, rank, offsets in
    # the packed P and Q buffers), the others packed raw in front of the Ps.
    __slots__ = ("matrices", "p_numel", "q_numel", "raw", "raw_numel")

    def __init__(
        self, buffer: torch.Tensor, gradients: list[torch.Tensor], state: PowerSGDState
    ) -> None:
        # Every view is cut from buffer itself, so results land in what the future returns.
        storage = buffer.untyped_storage().data_ptr()
        base = buffer.storage_offset()
        self.raw: list[torch.Tensor] = []
        self.matrices: list[tuple[torch.Tensor, int, int, int]] = []
        self.raw_numel = 0
        self.p_numel = 0
        self.q_numel = 0
        for grad in gradients:
            offset = grad.storage_offset() - base
            if grad.untyped_storage().data_ptr() != storage or not (
                0 <= offset <= buffer.numel() - grad.numel()
            ):
                raise RuntimeError(
                    "power_sgd_inplace_hook needs the bucket's gradients() to be views into "
                    "its buffer() (as DDP's buckets and kwplug's canonical buckets are)"
                )
            grad = buffer.narrow(0, offset, grad.numel()).view(grad.shape)
            rows = grad.shape[0] if grad.dim() > 0 else 1
            cols = grad.numel() // max(rows, 1)
            rank = min(rows, cols, int(state.matrix_approximation_rank))
            before = rows * cols
            after = (rows + cols) * rank
            state.total_numel_before_compression += before
            # torch's _should_compress: worth it when compressed * min_rate < uncompressed.
            if grad.dim() > 1 and after * state.min_compression_rate < before:
                self.matrices.append((grad.view(rows, cols), rank, self.p_numel, self.q_numel))
                self.p_numel += rows * rank
                self.q_numel += cols * rank
                state.total_numel_after_compression += after
            else:
                self.raw.append(grad.view(-1))
                self.raw_numel += grad.numel()
                state.total_numel_after_compression += before

    def errors(self, error: torch.Tensor) -> list[torch.Tensor]:
        # Each compressed matrix's slice of the bucket's error tensor: the matrices back to
        # back in the bucket's order (canonical under kwplug), whatever DDP's layout.
        out = []
        offset = 0
        for matrix, _, _, _ in self.matrices:
            out.append(error.narrow(0, offset, matrix.numel()).view(matrix.shape))
            offset += matrix.numel()
        return out

    @property
    def matrix_numel(self) -> int:
        return sum(matrix.numel() for matrix, _, _, _ in self.matrices)

    def factors(
        self, packed: torch.Tensor, q_flat: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        # (matrix, P^T view, Q^T view) per compressed gradient. The factors are kept
        # transposed, r x rows and r x cols: MKL's products with an n x 2 operand run 5-25x
        # slower than with a 2 x n one (e.g. M^T P 13 ms, P^T M 0.5 ms for 1024 x 1024).
        out = []
        for matrix, rank, p_at, q_at in self.matrices:
            rows, cols = matrix.shape
            p_t = packed.narrow(0, self.raw_numel + p_at, rows * rank).view(rank, rows)
            q_t = q_flat.narrow(0, q_at, cols * rank).view(rank, cols)
            out.append((matrix, p_t, q_t))
        return out


#: Up to this rank ``P Q^T`` is written as a sum of outer products (one elementwise pass per
#: rank, 0.3 ms for 1024 x 1024 here); above it by one matrix product (MKL's rank-2 product
#: into a 1024 x 1024 matrix: 1.5-2.5 ms).
_OUTER_MAX_RANK = 4


def _decompress(
    p_t: torch.Tensor,
    q_t: torch.Tensor,
    matrix: torch.Tensor,
    work: torch.Tensor,
    error_feedback: bool,
) -> None:
    # matrix (in DDP's bucket) = P Q^T; work holds M, and becomes the residual M - P Q^T
    # with error feedback. Matrix products only read and write work (the same offsets whatever
    # DDP's layout: MKL's results may depend on the operands' alignment, and a resumed run
    # must compute bit for bit what an uninterrupted one did); the bucket gets elementwise
    # writes only.
    rank = p_t.shape[0]
    if rank > _OUTER_MAX_RANK:
        if error_feedback:
            matrix.copy_(work)
            work.addmm_(p_t.t(), q_t, alpha=-1)
            matrix.sub_(work)
        else:
            torch.mm(p_t.t(), q_t, out=work)
            matrix.copy_(work)
        return
    for j in range(rank):
        column, row = p_t[j].unsqueeze(1), q_t[j]
        if j == 0:
            torch.mul(column, row, out=matrix)
        else:
            matrix.addcmul_(column, row)
    if error_feedback:
        work.sub_(matrix)  # one pass for the residual, whatever the rank


def _memory(memory: dict[Any, torch.Tensor], key: Any, numel: int, like: torch.Tensor) -> Any:
    # The tensor kept under key when it still fits this bucket, else None.
    kept = memory.get(key)
    if kept is None or kept.shape != (numel,) or kept.dtype != like.dtype:
        return None
    return kept if kept.device == like.device else None


def power_sgd_inplace_hook(
    state: PowerSGDState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Per-tensor PowerSGD with in-place error feedback and two collectives per bucket.

    The algorithm of torch's ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.
    powerSGD_hook``, with its state (``PowerSGDState``) and options. For the first
    ``state.start_powerSGD_iter`` steps the bucket is averaged by a plain all-reduce. Then, per
    step and bucket, each gradient of more than one dimension viewed as an ``rows x cols``
    matrix ``M`` (plus its error of the previous step when ``use_error_feedback``) is
    compressed when ``(rows + cols) * r * min_compression_rate < rows * cols`` (``r =
    min(rows, cols, matrix_approximation_rank)``): with ``Q`` (``cols x r``; random with a
    seed shared by all ranks, or last step's when ``warm_start``) orthonormalized, ``P = M Q``
    is all-reduced together with the uncompressed gradients (one flat buffer), ``P`` is
    orthonormalized, ``Q = M^T P`` is all-reduced and divided by the world size, and ``M``
    becomes ``P Q^T``; the uncompressed gradients become their average. The residual ``M - P
    Q^T`` is kept in place in ``state.error_dict`` (one tensor per bucket holding its
    compressed matrices back to back, written each step, never reallocated);
    ``state.p_memory_dict`` holds the flat ``[uncompressed, P^T]`` buffer and
    ``state.q_memory_dict`` the flat ``Q^T`` buffer of each bucket. Orthonormalization is
    Gram-Schmidt (a zero column stays zero).

    Differences from torch's hook: one all-reduce for the uncompressed tensors and ``P``
    (torch: two, one after the other), the ``Q`` all-reduce issued in bucket order over the
    state's second gloo group without waiting in a callback, no bucket-sized copy or
    allocation per step, and no error kept for the uncompressed tensors (torch's sums to zero
    over the ranks). Results match torch's hook to rounding (a test compares them). The
    saved state is not interchangeable with torch's hook's (other tensor sizes: a mismatch
    starts that bucket afresh).

    Args:
        state: a ``PowerSGDState`` (see
            :func:`~kwplug.plugins.ddp_comm_hooks.make_power_sgd_state`); every option
            applies except ``batch_tensors_with_same_shape`` and
            ``compression_stats_logging_frequency`` (the counters are kept, nothing is logged).
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

    key = bucket.index()
    layout = _Layout(buffer, bucket.gradients(), state)
    packed_numel = layout.raw_numel + layout.p_numel
    packed = _memory(state.p_memory_dict, key, packed_numel, buffer) if state.warm_start else None
    q_flat = _memory(state.q_memory_dict, key, layout.q_numel, buffer) if state.warm_start else None
    fresh = packed is None or q_flat is None
    if packed is None:
        packed = buffer.new_empty(packed_numel)
    if q_flat is None:
        q_flat = buffer.new_empty(layout.q_numel)
    # The matrices M, back to back in the bucket's order: with error feedback, last step's
    # residual plus this step's gradient, in place (the residual is then computed into it).
    feedback = bool(state.use_error_feedback)
    work = _memory(state.error_dict, key, layout.matrix_numel, buffer) if feedback else None
    if work is None:
        work = buffer.new_zeros(layout.matrix_numel)
        if feedback:
            state.error_dict[key] = work
    factors = layout.factors(packed, q_flat)
    works = layout.errors(work)
    if fresh:
        # As torch: one seed per bucket drawn from the state's RNG (the same on every rank),
        # then each Q (cols x r) drawn in turn from the CPU generator.
        generator = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
        for _, _, q_t in factors:
            q_t.t().copy_(torch.randn(q_t.t().shape, generator=generator, dtype=q_t.dtype))
    epsilon = float(state.orthogonalization_epsilon)
    for (matrix, p_t, q_t), m in zip(factors, works, strict=True):
        if feedback:
            m.add_(matrix)
        else:
            m.copy_(matrix)
        _orthonormalize_columns(q_t.t().unsqueeze(0), epsilon)
        torch.mm(q_t, m.t(), out=p_t)  # P^T = (M Q)^T
    if layout.raw:
        torch.cat(layout.raw, out=packed[: layout.raw_numel])
    p_future = all_reduce_async(packed, state.process_group)
    q_group = getattr(state, "q_process_group", None)
    previous: torch.futures.Future[Any] | None = getattr(state, "q_issued", None)
    issued: torch.futures.Future[None] = torch.futures.Future()
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    if q_group is not None:
        state.q_issued = issued  # type: ignore[attr-defined]

    def decompress(fut: torch.futures.Future[Any]) -> None:
        try:
            future_tensor(fut).div_(group_size)  # q_flat, summed over ranks
            for (matrix, p_t, q_t), m in zip(factors, works, strict=True):
                _decompress(p_t, q_t, matrix, m, feedback)
            if not state.warm_start:
                state.p_memory_dict.clear()
                state.q_memory_dict.clear()
            _count_step(state, bucket)
        except BaseException as exc:  # handed to DDP through the future
            result.set_exception(exc)  # type: ignore[arg-type]  # torch's stub is too narrow
            return
        result.set_result(buffer)

    def reduce_q(fut: torch.futures.Future[Any]) -> None:
        try:
            summed = future_tensor(fut)  # packed itself, summed over ranks
            if layout.raw:
                raw = summed[: layout.raw_numel].div_(group_size)
                offset = 0
                for grad in layout.raw:
                    grad.copy_(raw.narrow(0, offset, grad.numel()))
                    offset += grad.numel()
            for (_, p_t, q_t), m in zip(factors, works, strict=True):
                _orthonormalize_columns(p_t.t().unsqueeze(0), epsilon)
                torch.mm(p_t, m, out=q_t)  # Q^T = (M^T P)^T
            state.p_memory_dict[key] = packed
            state.q_memory_dict[key] = q_flat
            # Looked up, not captured: a callback never holds the last reference to a group.
            group = getattr(state, "q_process_group", None)
            q_future = all_reduce_async(q_flat, state.process_group if group is None else group)
        except BaseException as exc:  # handed to DDP through the future
            issued.set_result(None)
            result.set_exception(exc)  # type: ignore[arg-type]  # torch's stub is too narrow
            return
        issued.set_result(None)
        q_future.then(decompress)

    return _chain_q(previous, p_future, reduce_q, result, q_group)


# Orders its collectives itself (a second group for Q, or waiting when there is none), and
# works on the bucket's gradient views in place (no canonical gather and scatter copies).
setattr(power_sgd_inplace_hook, ORDERS_COLLECTIVES, True)
setattr(power_sgd_inplace_hook, IN_PLACE_VIEWS, True)

"""The ``"int8"`` and ``"topk"`` DDP communication hooks.

Both follow PyTorch's contract for ``DistributedDataParallel.register_comm_hook``:
``hook(state, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]``,
the future holding the gradient bucket averaged over the ranks. Each rank sends a compressed
payload with one ``torch.distributed.all_gather_single`` (``all_gather_into_tensor`` before
torch 2.13; gloo and nccl support both, int8 and int32 included). Summing compressed
payloads with an all-reduce would not work: int8 sums overflow and the ranks' top-k indices
differ. Every rank then decodes all payloads in rank order with the same operations, so all
ranks compute bitwise the same average and their parameters stay identical.

Collectives are called through the ``torch.distributed`` module attribute
(``dist.all_gather_single``), so a caller can wrap it to count what is sent (see
:mod:`kwplug_compress.measure`).

No ``from __future__ import annotations`` here: DDP compares a hook's ``bucket`` and return
annotations with the ``GradBucket`` and ``Future[Tensor]`` objects and refuses strings.
"""

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kwplug_compress._tiles import run_tiled
from kwplug_compress.state import BucketIndex, Int8State, Layout, TopKState

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket
else:
    GradBucket = dist.GradBucket  # the object DDP compares the annotation with

__all__ = [
    "TOPK_BLOCK",
    "TOPK_BLOCKED_MIN",
    "int8_bytes",
    "int8_hook",
    "topk_bytes",
    "topk_count",
    "topk_hook",
    "topk_select",
]

_INT8_MAX = 127  # symmetric range [-127, 127]: -128 would need a scale asymmetry


def int8_bytes(numel: int, chunk_size: int) -> int:
    """Bytes one rank sends per bucket with the ``"int8"`` hook.

    Args:
        numel: elements of the bucket.
        chunk_size: elements per float32 scale.

    Returns:
        ``numel`` (one int8 each) plus 4 bytes per chunk, ``ceil(numel / chunk_size)`` chunks.
    """
    return numel + 4 * math.ceil(numel / chunk_size)


def topk_count(numel: int, ratio: float) -> int:
    """``k = max(1, ceil(ratio * numel))``, at most ``numel``: entries sent per bucket."""
    return min(numel, max(1, math.ceil(ratio * numel)))


def topk_bytes(numel: int, ratio: float) -> int:
    """Bytes one rank sends per bucket with the ``"topk"`` hook: ``k`` float32 values and ``k``
    int32 indices, ``8 * k``."""
    return 8 * topk_count(numel, ratio)


def _corrected(
    buffer: torch.Tensor, bucket: GradBucket, state: Int8State | TopKState
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # The float32 gradient plus this bucket's residual (error feedback), and the residual to
    # overwrite (or None). With error feedback the residual itself becomes the corrected
    # gradient (one in-place add, no temporary): the hook reads what it sends from it before
    # overwriting it with what was not sent. Without, a float32 buffer is used as is.
    flat = buffer.reshape(-1)
    if not state.error_feedback:
        return flat.to(torch.float32), None
    parameters = list(bucket.parameters())
    layout: Layout = tuple(tuple(p.shape) for p in parameters)
    members = state.memory.members(bucket.index(), parameters)
    residual = state.memory.residual(bucket.index(), layout, flat, members)
    return residual.add_(flat), residual


def _keep_finite(residual: torch.Tensor) -> None:
    # An overflowing step (fp16 + GradScaler) is skipped by the scaler; its inf/NaN must not
    # poison every later step through the residual. nan_to_num does not synchronise a GPU.
    torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)


def _all_gather(
    payload: torch.Tensor, gathered: torch.Tensor, process_group: dist.ProcessGroup | None
) -> torch.futures.Future[Any]:
    # torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single (same
    # arguments), which older torch lacks. Looked up per call so that a wrapper counts it.
    gather: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(gathered, payload, group=process_group, async_op=True)
    if work is None:  # only when this rank is not a member of the group
        raise RuntimeError("this process is not a member of the hook's process group")
    future: torch.futures.Future[Any] = work.get_future()
    return future


def _cached(
    state: Int8State | TopKState,
    index: BucketIndex,
    role: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    # A tensor this bucket's hook reuses every step (payload, gathered payloads, work space):
    # a fresh bucket-sized allocation costs page faults, often more than the arithmetic. DDP
    # waits for every bucket's future before the next step, so a step never reuses a tensor
    # that is still in flight.
    key = (index, role)
    tensor = state.buffers.get(key)
    if tensor is None or tensor.shape != shape or tensor.dtype != dtype or tensor.device != device:
        tensor = state.buffers[key] = torch.empty(shape, dtype=dtype, device=device)
    return tensor


# -- int8 -------------------------------------------------------------------------------------


def _quantize_rows(
    rows: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor, work: torch.Tensor
) -> None:
    # ``rows`` (chunks, chunk_size) float32 -> float32 ``scales`` (chunks,) and int8 ``codes``
    # (chunks * chunk_size,), written in place; ``work`` (like ``rows``) is left holding the
    # integer steps. max(amax, -amin) is the infinity norm without a bucket-sized abs();
    # both propagate NaN, and an inf makes it inf, so such a chunk's scale is non-finite.
    torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_(), out=scales)
    scales.div_(_INT8_MAX)
    # All-zero chunks: any finite factor gives code 0; 1/0 would give NaN (0 * inf).
    inverse = torch.where(scales > 0, scales.reciprocal(), 0.0)
    torch.mul(rows, inverse[:, None], out=work).clamp_(-_INT8_MAX, _INT8_MAX).round_()
    codes.copy_(work.view(-1))


def _quantize(
    flat: torch.Tensor, chunk_size: int, payload: torch.Tensor, work: torch.Tensor
) -> torch.Tensor:
    # Writes the payload: the float32 scales viewed as bytes, then one int8 per element
    # (scales first so that they start 4-byte aligned). Whole chunks are a view of ``flat``;
    # the short last chunk, if any, is quantised on its own. Returns the scales; ``work``
    # (float32, numel) holds the integer steps.
    numel = flat.numel()
    whole, rest = divmod(numel, chunk_size)
    chunks = whole + (rest > 0)
    main = whole * chunk_size
    scales = payload[: 4 * chunks].view(torch.float32)
    codes = payload[4 * chunks :]
    _quantize_rows(flat[:main].view(whole, chunk_size), scales[:whole], codes[:main],
                   work[:main].view(whole, chunk_size))  # fmt: skip
    if rest:
        _quantize_rows(flat[main:].view(1, rest), scales[whole:], codes[main:],
                       work[main:].view(1, rest))  # fmt: skip
    return scales


def _decoded(work: torch.Tensor, scales: torch.Tensor, chunk_size: int) -> torch.Tensor:
    # What the codes in ``work`` decode to, in place. Decoded with the scale itself, not its
    # inverse: a NaN/inf chunk decodes to non-finite values, so a GradScaler still sees the
    # overflow and skips the step.
    numel = work.numel()
    whole, rest = divmod(numel, chunk_size)
    main = whole * chunk_size
    work[:main].view(whole, chunk_size).mul_(scales[:whole, None])
    if rest:
        work[main:].mul_(scales[whole:])
    return work


def _dequantize_sum(
    gathered: torch.Tensor, numel: int, chunk_size: int, decoded: torch.Tensor, out: torch.Tensor
) -> None:
    # Decodes every rank's payload at once into ``decoded`` (world, numel) float32 and writes
    # their sum over ranks into ``out`` (numel,).
    world_size = decoded.shape[0]
    whole, rest = divmod(numel, chunk_size)
    chunks = whole + (rest > 0)
    main = whole * chunk_size
    rows = gathered.view(world_size, -1)
    # Copied: a row's scales may start at an offset float32 cannot view.
    scales = torch.empty((world_size, 4 * chunks), dtype=torch.int8, device=gathered.device)
    scales = scales.copy_(rows[:, : 4 * chunks]).view(torch.float32)
    codes = rows[:, 4 * chunks :]
    torch.mul(
        codes[:, :main].view(world_size, whole, chunk_size),
        scales[:, :whole, None],
        out=decoded[:, :main].view(world_size, whole, chunk_size),
    )
    if rest:
        torch.mul(codes[:, main:], scales[:, whole:], out=decoded[:, main:])
    torch.sum(decoded, dim=0, out=out)


def int8_hook(state: Int8State, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the ranks, exchanging it quantised to int8.

    Per chunk of ``state.chunk_size`` elements, the scale is ``max|g| / 127`` and each element
    is sent as ``round(g * (1 / scale))`` in int8, clamped to [-127, 127]; the scales travel as
    float32. Each rank sends :func:`int8_bytes` bytes (about a quarter of float32) with one
    ``torch.distributed.all_gather_single``, then decodes every rank's payload in float32,
    sums them over the ranks and divides by the world size. The error per element is at most
    half a step, ``scale / 2``, per rank (plus a rounding of the reciprocal). With
    ``state.error_feedback`` the rounding error is added to the bucket's next gradient. A chunk
    holding inf or NaN decodes to non-finite values, so ``torch.amp.GradScaler`` still detects
    the overflow. The payload, the gathered payloads and the work space are allocated once
    per bucket and reused.

    Args:
        state: :class:`~kwplug_compress.state.Int8State` (``make_int8_state`` builds it from
            ``comm_state_option``).
        bucket: the ``torch.distributed.GradBucket`` DDP hands to the hook; its buffer may be
            any floating dtype (e.g. float16 under ``comm_wrapper="fp16"``).

    Returns:
        A ``torch.futures.Future`` of ``bucket.buffer()``, overwritten in place with the
        average.

    Raises:
        RuntimeError: this process is not a member of ``state.process_group``.
    """
    tiled = run_tiled(int8_hook, state, bucket)  # a resumed run's first step
    if tiled is not None:
        return tiled
    buffer = bucket.buffer()
    world_size = dist.get_world_size(state.process_group)
    numel, chunk_size = buffer.numel(), state.chunk_size
    index, device = bucket.index(), buffer.device
    corrected, residual = _corrected(buffer, bucket, state)
    width = int8_bytes(numel, chunk_size)
    payload = _cached(state, index, "payload", (width,), torch.int8, device)
    gathered = _cached(state, index, "gathered", (world_size * width,), torch.int8, device)
    work = _cached(state, index, "work", (numel,), torch.float32, device)
    scales = _quantize(corrected, chunk_size, payload, work)
    if residual is not None:
        residual.sub_(_decoded(work, scales, chunk_size))  # it held the corrected gradient
        _keep_finite(residual)
    future = _all_gather(payload, gathered, state.process_group)

    def decode(_: torch.futures.Future[Any]) -> torch.Tensor:
        flat = buffer.view(-1)
        total = flat if flat.dtype == torch.float32 else work
        decoded = _cached(state, index, "decoded", (world_size, numel), torch.float32, device)
        _dequantize_sum(gathered, numel, chunk_size, decoded, total)
        total.div_(world_size)
        if total is not flat:
            flat.copy_(total)
        return buffer

    return future.then(decode)


# -- top-k ------------------------------------------------------------------------------------

#: Elements per block of the top-k selection in large buckets (see :func:`topk_select`).
TOPK_BLOCK = 1024
#: Buckets of fewer elements select the exact top k (a block pass would gain nothing).
TOPK_BLOCKED_MIN = 64 * TOPK_BLOCK


def topk_select(
    corrected: torch.Tensor, k: int, magnitude: torch.Tensor | None = None
) -> torch.Tensor:
    """The indices (int64, unordered) of the ``k`` entries the ``"topk"`` hook sends.

    A bucket of fewer than :data:`TOPK_BLOCKED_MIN` elements sends its exact top ``k`` by
    magnitude. A larger one is cut into blocks of :data:`TOPK_BLOCK` elements (the last may
    be shorter); each block proposes its ``ceil(k / blocks)`` largest entries, and the ``k``
    largest of these candidates are sent. That is the exact top ``k`` unless one block holds
    more than ``ceil(k / blocks)`` of them; then a smaller entry of another block is sent in
    their place (with error feedback the unsent ones stay in the residual and are sent
    later). A row-wise ``topk`` over short rows costs a fraction of one over the whole bucket.
    ``torch.topk`` ranks NaN above every number, so a non-finite entry is always proposed.

    Args:
        corrected: the 1-D float32 corrected gradient.
        k: how many indices, ``1 <= k <= corrected.numel()``.
        magnitude: optional work space like ``corrected`` for ``|corrected|``.

    Returns:
        ``k`` distinct indices into ``corrected`` (``torch.int64``).
    """
    numel = corrected.numel()
    magnitude = torch.abs(corrected, out=magnitude) if magnitude is not None else corrected.abs()
    blocks = -(-numel // TOPK_BLOCK)
    per_block = -(-k // blocks)
    if numel < TOPK_BLOCKED_MIN or per_block * 2 > TOPK_BLOCK:
        return magnitude.topk(k, sorted=False).indices
    whole = numel // TOPK_BLOCK
    rows = magnitude[: whole * TOPK_BLOCK].view(whole, TOPK_BLOCK).topk(per_block, sorted=False)
    starts = torch.arange(0, whole * TOPK_BLOCK, TOPK_BLOCK, device=corrected.device)
    values, indices = [rows.values.view(-1)], [rows.indices.add_(starts[:, None]).view(-1)]
    if whole < blocks:  # the short last block
        tail = magnitude[whole * TOPK_BLOCK :]
        last = tail.topk(min(per_block, tail.numel()), sorted=False)
        values.append(last.values)
        indices.append(last.indices.add_(whole * TOPK_BLOCK))
    chosen = torch.cat(values).topk(k, sorted=False).indices
    return torch.cat(indices)[chosen]


def topk_hook(state: TopKState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the ranks, each rank sending only ``k`` of its entries.

    Top-k sparsification with error feedback (Stich et al., 2018, "Sparsified SGD with
    memory"; Lin et al., 2018, "Deep Gradient Compression"): the gradient plus the bucket's
    residual is the corrected gradient; ``k = max(1, ceil(state.ratio * numel))`` of its
    entries of largest magnitude (:func:`topk_select`: the exact top ``k`` in buckets under
    :data:`TOPK_BLOCKED_MIN` elements, the top ``k`` of per-block candidates above) are sent as
    ``k`` float32 values and ``k`` int32 indices, :func:`topk_bytes` = ``8 k`` bytes, with one
    ``torch.distributed.all_gather_single``. Every rank adds all ranks' entries into a
    dense zero tensor in rank order (``index_add_``; one rank's indices are distinct, so the
    result is deterministic on GPUs too) and divides by the world size. The residual becomes
    the corrected gradient minus what was sent, exactly. With ``ratio=1.0`` the result equals
    the plain average; ``ratio >= 0.5`` sends more than a float32 all-reduce.

    Args:
        state: :class:`~kwplug_compress.state.TopKState` (``make_topk_state`` builds it from
            ``comm_state_option``).
        bucket: the ``torch.distributed.GradBucket`` DDP hands to the hook.

    Returns:
        A ``torch.futures.Future`` of ``bucket.buffer()``, overwritten in place with the
        average.

    Raises:
        RuntimeError: the bucket has 2**31 elements or more (indices travel as int32), or
            this process is not a member of ``state.process_group``.
    """
    tiled = run_tiled(topk_hook, state, bucket)  # a resumed run's first step
    if tiled is not None:
        return tiled
    buffer = bucket.buffer()
    world_size = dist.get_world_size(state.process_group)
    numel = buffer.numel()
    if numel > torch.iinfo(torch.int32).max:
        raise RuntimeError(f"topk: a bucket of {numel} elements exceeds int32 indices")
    index = bucket.index()
    corrected, residual = _corrected(buffer, bucket, state)
    k = topk_count(numel, state.ratio)
    device = buffer.device
    indices = topk_select(
        corrected, k, _cached(state, index, "work", (numel,), torch.float32, device)
    )
    # One int32 payload: the float32 values' bits, then the indices.
    payload = _cached(state, index, "payload", (2 * k,), torch.int32, device)
    gathered = _cached(state, index, "gathered", (world_size * 2 * k,), torch.int32, device)
    torch.index_select(corrected, 0, indices, out=payload[:k].view(torch.float32))
    payload[k:].copy_(indices)
    if residual is not None:
        residual.index_fill_(0, indices, 0.0)  # it held the corrected gradient
        _keep_finite(residual)
    future = _all_gather(payload, gathered, state.process_group)

    def decode(_: torch.futures.Future[Any]) -> torch.Tensor:
        flat = buffer.view(-1)
        dense = flat if flat.dtype == torch.float32 else state.buffers[(index, "work")]
        dense.zero_()
        blocks = gathered.view(world_size, 2 * k)
        for rank in range(world_size):
            dense.index_add_(0, blocks[rank, k:].long(), blocks[rank, :k].view(torch.float32))
        dense.div_(world_size)
        if dense is not flat:
            flat.copy_(dense)
        return buffer

    return future.then(decode)

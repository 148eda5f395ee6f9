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

from kwplug_compress.state import Int8State, Layout, TopKState

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket
else:
    GradBucket = dist.GradBucket  # the object DDP compares the annotation with

__all__ = ["int8_bytes", "int8_hook", "topk_bytes", "topk_count", "topk_hook"]

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


def _layout(bucket: GradBucket) -> Layout:
    return tuple(tuple(p.shape) for p in bucket.parameters())


def _corrected(
    buffer: torch.Tensor, index: int, layout: Layout, state: Int8State | TopKState
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # float32 gradient plus this bucket's residual (error feedback), never aliasing the buffer
    # when it will be updated in place later; and the residual to overwrite, or None.
    flat = buffer.reshape(-1)
    if not state.error_feedback:
        return flat.to(torch.float32), None
    residual = state.memory.residual(index, layout, flat)
    return flat.to(torch.float32) + residual, residual


def _keep_finite(residual: torch.Tensor) -> None:
    # An overflowing step (fp16 + GradScaler) is skipped by the scaler; its inf/NaN must not
    # poison every later step through the residual. nan_to_num does not synchronise a GPU.
    torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)


def _all_gather(
    payload: torch.Tensor, process_group: dist.ProcessGroup | None, world_size: int
) -> tuple[torch.Tensor, torch.futures.Future[Any]]:
    gathered = payload.new_empty(world_size * payload.numel())
    # torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single (same
    # arguments), which older torch lacks. Looked up per call so that a wrapper counts it.
    gather: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(gathered, payload, group=process_group, async_op=True)
    if work is None:  # only when this rank is not a member of the group
        raise RuntimeError("this process is not a member of the hook's process group")
    return gathered, work.get_future()


# -- int8 -------------------------------------------------------------------------------------


def _quantize(flat: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Returns (payload, what the payload decodes to). Payload: the float32 scales viewed as
    # bytes, then one int8 per element; scales first so that they start 4-byte aligned.
    numel = flat.numel()
    chunks = math.ceil(numel / chunk_size)
    padded = torch.nn.functional.pad(flat, (0, chunks * chunk_size - numel)).view(chunks, -1)
    scale = padded.abs().amax(dim=1) / _INT8_MAX  # NaN/inf in a chunk make its scale non-finite
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = (padded / divisor[:, None]).round_().clamp_(-_INT8_MAX, _INT8_MAX)
    # Decoded with the scale itself, not the divisor: a NaN/inf chunk decodes to non-finite
    # values, so a GradScaler still sees the overflow and skips the step.
    decoded = (quantized * scale[:, None]).reshape(-1)[:numel]
    codes = quantized.to(torch.int8).reshape(-1)[:numel]
    return torch.cat([scale.view(torch.int8), codes]), decoded


def _dequantize(payload: torch.Tensor, numel: int, chunk_size: int) -> torch.Tensor:
    chunks = math.ceil(numel / chunk_size)
    # clone(): the slice of the gathered tensor may start at an offset float32 cannot view.
    scale = payload[: 4 * chunks].clone().view(torch.float32)
    codes = torch.nn.functional.pad(
        payload[4 * chunks :].to(torch.float32), (0, chunks * chunk_size - numel)
    )
    return (codes.view(chunks, -1) * scale[:, None]).reshape(-1)[:numel]


def int8_hook(state: Int8State, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the ranks, exchanging it quantised to int8.

    Per chunk of ``state.chunk_size`` elements, the scale is ``max|g| / 127`` and each element
    is sent as ``round(g / scale)`` in int8; the scales travel as float32. Each rank sends
    :func:`int8_bytes` bytes (about a quarter of float32) with one
    ``torch.distributed.all_gather_single``, then decodes every rank's payload in float32,
    sums them in rank order and divides by the world size. The error per element is at most
    half a step, ``scale / 2``, per rank. With ``state.error_feedback`` the rounding error is
    added to the bucket's next gradient. A chunk holding inf or NaN decodes to non-finite
    values, so ``torch.amp.GradScaler`` still detects the overflow.

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
    buffer = bucket.buffer()
    world_size = dist.get_world_size(state.process_group)
    numel, chunk_size = buffer.numel(), state.chunk_size
    corrected, residual = _corrected(buffer, bucket.index(), _layout(bucket), state)
    payload, sent = _quantize(corrected, chunk_size)
    if residual is not None:
        torch.sub(corrected, sent, out=residual)
        _keep_finite(residual)
    gathered, future = _all_gather(payload, state.process_group, world_size)
    width = payload.numel()

    def decode(_: torch.futures.Future[Any]) -> torch.Tensor:
        total = torch.zeros(numel, dtype=torch.float32, device=buffer.device)
        for rank in range(world_size):
            total += _dequantize(gathered[rank * width : (rank + 1) * width], numel, chunk_size)
        buffer.copy_(total.div_(world_size).view_as(buffer))
        return buffer

    return future.then(decode)


# -- top-k ------------------------------------------------------------------------------------


def topk_hook(state: TopKState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the ranks, each rank sending only its top-k entries.

    Top-k sparsification with error feedback (Stich et al., 2018, "Sparsified SGD with
    memory"; Lin et al., 2018, "Deep Gradient Compression"): the gradient plus the bucket's
    residual is the corrected gradient; its ``k = max(1, ceil(state.ratio * numel))`` entries
    of largest magnitude (``torch.topk``) are sent as ``k`` float32 values and ``k`` int32
    indices, :func:`topk_bytes` = ``8 k`` bytes, with one
    ``torch.distributed.all_gather_single``. Every rank adds all ranks' entries into a
    dense zero tensor in rank order (``index_add_``; one rank's indices are distinct, so the
    result is deterministic on GPUs too) and divides by the world size. The residual becomes
    the corrected gradient minus what was sent. With ``ratio=1.0`` the result equals the plain
    average; ``ratio >= 0.5`` sends more than a float32 all-reduce.

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
    buffer = bucket.buffer()
    world_size = dist.get_world_size(state.process_group)
    numel = buffer.numel()
    if numel > torch.iinfo(torch.int32).max:
        raise RuntimeError(f"topk: a bucket of {numel} elements exceeds int32 indices")
    corrected, residual = _corrected(buffer, bucket.index(), _layout(bucket), state)
    k = topk_count(numel, state.ratio)
    # torch.topk ranks NaN above every number, so a non-finite gradient is always sent.
    indices = corrected.abs().topk(k, sorted=False).indices
    values = corrected[indices]
    if residual is not None:
        residual.copy_(corrected).index_fill_(0, indices, 0.0)
        _keep_finite(residual)
    # One int32 payload: the float32 values' bits, then the indices.
    payload = torch.cat([values.view(torch.int32), indices.to(torch.int32)])
    gathered, future = _all_gather(payload, state.process_group, world_size)

    def decode(_: torch.futures.Future[Any]) -> torch.Tensor:
        dense = torch.zeros(numel, dtype=torch.float32, device=buffer.device)
        for rank in range(world_size):
            block = gathered[rank * 2 * k : (rank + 1) * 2 * k]
            dense.index_add_(0, block[k:].to(torch.int64), block[:k].view(torch.float32))
        buffer.copy_(dense.div_(world_size).view_as(buffer))
        return buffer

    return future.then(decode)

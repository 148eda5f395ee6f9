"""Plain and low-precision all-reduce hooks, and the ``comm_wrapper`` compression wrappers.

The three hooks do what torch's own (``torch.distributed.algorithms.ddp_comm_hooks.
default_hooks``) do, under kwplug's names, which DDP logs (the low-precision ones reuse their
low-precision copy of each bucket instead of allocating it every step); for bfloat16 the
name matters more: ``DistributedDataParallel`` refuses a hook *named* ``bf16_compress_hook``
or ``bf16_compress_wrapper_hook`` unless CUDA with NCCL >= 2.10 (or XPU with XCCL) is present,
although gloo all-reduces ``torch.bfloat16`` tensors fine. The wrappers are kwplug's: they
return the bucket's own full-precision buffer (torch's return the low-precision copy) and are
not named like torch's bfloat16 wrapper, for the same reason.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from kwplug.comm_hooks import HookFn
from kwplug.plugins.ddp_comm_hooks._common import (
    GradBucket,
    all_reduce_async,
    describe,
    future_tensor,
)

# The hooks below do torch's work under kwplug's own names: DDP logs a hook's __qualname__
# (``_get_ddp_logging_data()["comm_hook"]``), and for bf16 refuses torch's name.


def mean_allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the gradient bucket over the group with one asynchronous all-reduce.

    Runs torch's ``default_hooks.allreduce_hook``: what DDP does without a hook. kwplug uses it
    as the inner hook when ``comm_wrapper`` is set but ``comm_hook`` is ``"no"``.

    Args:
        process_group: ``torch.distributed.ProcessGroup`` to reduce over; ``None`` = the
            default (world) group.
        bucket: the ``torch.distributed.GradBucket`` DDP hands to the hook.

    Returns:
        A future of the bucket buffer, divided by the world size and summed in place.
    """
    # torch annotates ProcessGroup but treats None as the default group, as DDP passes it.
    return default_hooks.allreduce_hook(process_group, bucket)  # type: ignore[arg-type]


#: Low-precision copies of bucket buffers, by (data pointer, numel, dtype, device): DDP keeps a
#: bucket's buffer for the whole training, so its copy is allocated once rather than per step
#: (a fresh bucket-sized tensor costs page faults on the CPU). Cleared when it grows past
#: :data:`_MAX_COPIES` (buffers that change every step, e.g. under a compression wrapper).
_LOW_PRECISION_COPIES: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}
_MAX_COPIES = 64


def _low_precision_allreduce(
    process_group: dist.ProcessGroup | None, bucket: GradBucket, dtype: torch.dtype
) -> torch.futures.Future[torch.Tensor]:
    # torch's default_hooks._compress_hook, step for step (cast, then divide in ``dtype``, so
    # the numerics are torch's), writing the cast into a copy kept per bucket buffer.
    if torch.compiler.is_compiling():
        return default_hooks._compress_hook(dtype, process_group, bucket)  # type: ignore[arg-type]
    buffer = bucket.buffer()
    key = (buffer.data_ptr(), buffer.numel(), dtype, buffer.device)
    compressed = _LOW_PRECISION_COPIES.get(key)
    if compressed is None:
        if len(_LOW_PRECISION_COPIES) >= _MAX_COPIES:
            _LOW_PRECISION_COPIES.clear()
        compressed = torch.empty_like(buffer, dtype=dtype)
        _LOW_PRECISION_COPIES[key] = compressed
    compressed.copy_(buffer).div_(dist.get_world_size(process_group))

    def decompress(fut: torch.futures.Future[Any]) -> torch.Tensor:
        buffer.copy_(future_tensor(fut))
        return buffer

    return all_reduce_async(compressed, process_group).then(decompress)


def fp16_compress_allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with an all-reduce in ``torch.float16`` (half the traffic of fp32).

    What torch's ``default_hooks.fp16_compress_hook`` does, with the same numerics: the bucket
    buffer is cast to float16, divided by the world size (in float16), all-reduced
    asynchronously, and the result is copied back into the buffer in its own dtype. The
    float16 copy is allocated once per bucket buffer and reused every step. Works with every
    backend that all-reduces float16 (gloo, nccl).

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

    What torch's ``default_hooks.bf16_compress_hook`` does (float32's range, 8 bits of
    mantissa; the bfloat16 copy reused as in :func:`fp16_compress_allreduce_hook`) under a
    name ``DistributedDataParallel`` does not refuse, so that it works on any backend that
    all-reduces bfloat16, including gloo on CPU. Arguments as for
    :func:`fp16_compress_allreduce_hook`; the future holds the averaged bucket buffer in its
    original dtype, at bfloat16 precision.
    """
    return _low_precision_allreduce(process_group, bucket, torch.bfloat16)


def _compress_wrapper(hook: HookFn, dtype: torch.dtype, label: str) -> HookFn:
    if not callable(hook):
        raise TypeError(f"{label} wraps a callable hook(state, bucket), got {hook!r}")

    def wrapped(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        full = bucket.buffer()
        bucket.set_buffer(full.to(dtype))
        inner_future = hook(state, bucket)

        def decompress(fut: torch.futures.Future[Any]) -> torch.Tensor:
            full.copy_(future_tensor(fut))
            return full

        return inner_future.then(decompress)

    inner_name = describe(hook)
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

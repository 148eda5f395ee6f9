"""Collective operations on nested data, built on ``torch.distributed``.

These are Accelerate's free functions (``accelerate.utils.gather`` ...). They act on the
default process group when one is initialised with more than one process, and return their
input (or a copy, for :func:`reduce`) otherwise. Every process must call them in the same order.

Unlike Accelerate (which checks only in its debug mode), :func:`gather`, :func:`reduce` and
:func:`broadcast` first compare the structure, shapes and dtypes of every process's data with
one 8-byte ``all_gather``; a mismatch raises :class:`DistributedOperationException` (a
``ValueError``) on every process, naming each rank's shapes, instead of returning garbage or
aborting inside the backend.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist

from kwplug.utils.structures import (  # Accelerate's operations module has them
    convert_outputs_to_fp32,
    is_namedtuple,
    pad_input_tensors,
    recursively_apply,
)

__all__ = [
    "CannotPadNestedTensorWarning",
    "DistributedOperationException",
    "broadcast",
    "broadcast_object_list",
    "convert_outputs_to_fp32",
    "copy_tensor_to_devices",
    "gather",
    "gather_object",
    "is_namedtuple",
    "pad_across_processes",
    "pad_input_tensors",
    "reduce",
]


class DistributedOperationException(ValueError):
    """The processes passed data of different structure, shapes or dtypes to a collective."""


class CannotPadNestedTensorWarning(UserWarning):
    """:func:`pad_across_processes` left a nested (jagged) tensor unpadded."""


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


def _object_device(data: Any) -> torch.device:
    """The device a small collective of ours runs on: the first tensor's, else the device the
    backend needs (an accelerator for NCCL-like backends, the CPU for gloo)."""
    found: list[torch.device] = []
    recursively_apply(lambda t: found.append(t.device), data)
    if found:
        return found[0]
    backend = str(dist.get_backend())
    accelerator = getattr(torch, "accelerator", None)
    if "gloo" in backend or "mpi" in backend or accelerator is None:
        return torch.device("cpu")
    if not accelerator.is_available():
        return torch.device("cpu")
    kind = accelerator.current_accelerator().type
    return torch.device(kind, accelerator.current_device_index())


def _signature(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return ("tensor", tuple(data.shape), str(data.dtype))
    if isinstance(data, (tuple, list)):
        return ("sequence", tuple(_signature(d) for d in data))
    if isinstance(data, Mapping):
        return ("mapping", tuple((repr(k), _signature(v)) for k, v in data.items()))
    return ("object", type(data).__name__)


def _describe(data: Any, path: str = "") -> list[str]:
    """``["['logits'] shape [8, 2] float32", ...]``: every tensor of ``data`` with its path."""
    if isinstance(data, torch.Tensor):
        dtype = str(data.dtype).removeprefix("torch.")
        return [f"{path + ' ' if path else ''}shape {list(data.shape)} {dtype}"]
    items: Any = ()
    if isinstance(data, (tuple, list)):
        items = enumerate(data)
    elif isinstance(data, Mapping):
        items = ((repr(k), v) for k, v in data.items())
    return [line for key, value in items for line in _describe(value, f"{path}[{key}]")] or [
        f"{path + ' ' if path else ''}no tensor"
    ]


def _check_same_shapes(data: Any, operation: str) -> None:
    """Raise on every process unless all processes hold data of one structure, shape and
    dtype. One 8-byte all_gather; a second one (of the descriptions) only on a mismatch."""
    digest = hashlib.blake2b(repr(_signature(data)).encode(), digest_size=8).digest()
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
    mine = mine.to(_object_device(data))
    everyone = [torch.empty_like(mine) for _ in range(_world_size())]
    dist.all_gather(everyone, mine)
    if all(torch.equal(everyone[0], other) for other in everyone[1:]):
        return
    # Every process saw the same digests, so every process takes this branch together.
    descriptions: list[Any] = [None] * len(everyone)
    dist.all_gather_object(descriptions, _describe(data))
    lines = "\n".join(f"  rank {r}: {', '.join(d)}" for r, d in enumerate(descriptions))
    raise DistributedOperationException(
        f"{operation} needs tensors of the same structure, shape and dtype on every process; "
        f"got:\n{lines}\n(pad them with kwplug.utils.pad_across_processes first)"
    )


def _validate_tensors(data: Any, operation: str) -> None:
    # Before any collective: a TypeError on one rank must not leave the others waiting in one.
    def check(tensor: torch.Tensor) -> None:
        pass

    check.__name__ = operation
    recursively_apply(check, data, error_on_other_type=True)


def gather(tensor: Any) -> Any:
    """Concatenate each tensor of nested data from every process along dimension 0.

    0-d tensors become 1-d first, so a scalar gathers to shape ``(num_processes,)``. In one
    process the input is returned unchanged (0-d tensors stay 0-d, as in Accelerate).

    Args:
        tensor: a tensor or nested tuples/lists/mappings of tensors, with the same structure,
            shapes and dtypes on every process (see :func:`pad_across_processes`).

    Returns:
        The same structure, each tensor of shape ``(num_processes * n, ...)``, rank 0's first.

    Raises:
        TypeError: a leaf is not a tensor.
        DistributedOperationException: the processes' structures, shapes or dtypes differ
            (a ``ValueError`` naming each rank's shapes).
    """
    world_size = _world_size()
    if world_size == 1:
        return tensor
    _validate_tensors(tensor, "gather")
    _check_same_shapes(tensor, "gather")

    def gather_one(t: torch.Tensor) -> torch.Tensor:
        t = (t.reshape(1) if t.dim() == 0 else t).contiguous()
        if t.device.type == "cpu":  # gloo has no all_gather_into_tensor
            parts = [torch.empty_like(t) for _ in range(world_size)]
            dist.all_gather(parts, t)
            return torch.cat(parts, dim=0)
        out = t.new_empty((world_size * t.shape[0], *t.shape[1:]))
        dist.all_gather_into_tensor(out, t)
        return out

    return recursively_apply(gather_one, tensor, error_on_other_type=True)


def gather_object(object: Any) -> Any:
    """Gather a picklable object from every process (``torch.distributed.all_gather_object``).

    Args:
        object: usually a list; each process's list is concatenated, rank 0's first. Any other
            object counts as one element (Accelerate iterates it, so a dict contributes its
            keys and a non-iterable raises).

    Returns:
        A flat list of every process's elements; in one process, ``object`` unchanged.
    """
    world_size = _world_size()
    if world_size == 1:
        return object
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, object)
    result: list[Any] = []
    for part in gathered:
        if isinstance(part, (list, tuple)):
            result.extend(part)
        else:
            result.append(part)
    return result


def reduce(
    tensor: Any,
    reduction: Literal["mean", "sum", "max"] = "mean",
    scale: float = 1.0,
) -> Any:
    """All-reduce a copy of each tensor of nested data across processes.

    Args:
        tensor: a tensor or nested tuples/lists/mappings of tensors, the same shapes and dtypes
            on every process.
        reduction: ``"mean"`` (default: the sum divided by the number of processes; needs a
            floating-point dtype), ``"sum"`` or ``"max"``.
        scale: accepted for Accelerate's signature; as there, it only applies on XLA, which
            kwplug does not run on, so it is ignored.

    Returns:
        The same structure with reduced copies; in one process, copies of the inputs.

    Raises:
        ValueError: an unknown ``reduction`` (Accelerate silently sums for any other string,
            ``"none"`` included).
        TypeError: a leaf is not a tensor.
        DistributedOperationException: the processes' shapes or dtypes differ.
    """
    if reduction not in ("mean", "sum", "max"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'max', got {reduction!r}")
    world_size = _world_size()
    if world_size > 1:
        _validate_tensors(tensor, "reduce")
        _check_same_shapes(tensor, "reduce")

    def reduce_one(t: torch.Tensor) -> torch.Tensor:
        copy = t.clone()
        if world_size == 1:
            return copy
        op = dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM
        dist.all_reduce(copy, op=op)
        if reduction == "mean":
            copy /= world_size
        return copy

    return recursively_apply(reduce_one, tensor, error_on_other_type=True)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Copy each tensor of nested data from process ``from_process`` to every process, in place.

    Args:
        tensor: a tensor or nested tuples/lists/mappings of tensors; every process passes
            tensors of the same shapes and dtypes, which receive the values.
        from_process: the global rank whose values are sent.

    Returns:
        The same structure holding the (overwritten) input tensors.

    Raises:
        TypeError: a leaf is not a tensor.
        ValueError: ``from_process`` is not a rank.
        DistributedOperationException: the processes' shapes or dtypes differ.
    """
    world_size = _world_size()
    if world_size == 1:
        return tensor
    if not 0 <= from_process < world_size:
        raise ValueError(f"from_process must be a rank in [0, {world_size}), got {from_process}")
    _validate_tensors(tensor, "broadcast")
    _check_same_shapes(tensor, "broadcast")

    def broadcast_one(t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=from_process)
        return t

    return recursively_apply(broadcast_one, tensor, error_on_other_type=True)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace, in place, the items of ``object_list`` with those of process ``from_process``
    (``torch.distributed.broadcast_object_list``); every process passes a list of one length.

    Returns:
        ``object_list``.
    """
    if _world_size() > 1:
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Send a tensor that exists on one process only to every process (Accelerate's name).

    Unlike :func:`broadcast`, the receivers need not know its shape or dtype: they pass
    ``None``. One ``torch.distributed.all_gather_object`` finds the holder and its shape and
    dtype, then ``torch.distributed.broadcast`` sends the values from it.

    Args:
        tensor: the tensor on exactly one process; ``None`` on every other.

    Returns:
        The tensor, on every process (the holder's own object; a new tensor elsewhere, on the
        collective's device).

    Raises:
        ValueError: no process or more than one process passed a tensor (on every process).
        TypeError: ``tensor`` is neither a tensor nor ``None``.
    """
    if tensor is not None and not isinstance(tensor, torch.Tensor):
        raise TypeError(f"copy_tensor_to_devices takes a tensor or None, got {type(tensor)!r}")
    world_size = _world_size()
    if world_size == 1:
        if tensor is None:
            raise ValueError("copy_tensor_to_devices: no process passed a tensor")
        return tensor
    mine = None if tensor is None else (tuple(tensor.shape), str(tensor.dtype))
    described: list[Any] = [None] * world_size
    dist.all_gather_object(described, mine)
    holders = [rank for rank, item in enumerate(described) if item is not None]
    if len(holders) != 1:
        raise ValueError(
            "copy_tensor_to_devices needs the tensor on exactly one process and None on the "
            f"others; ranks holding one: {holders}"
        )
    shape, dtype_name = described[holders[0]]
    if tensor is None:
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        tensor = torch.empty(shape, dtype=dtype, device=_object_device(None))
    dist.broadcast(tensor, src=holders[0])
    return tensor


def pad_across_processes(
    tensor: Any, dim: int = 0, pad_index: int | float = 0, pad_first: bool = False
) -> Any:
    """Pad each tensor of nested data along ``dim`` to its largest size on any process, so
    that :func:`gather` can concatenate them.

    The sizes are exchanged with one ``all_gather_object`` for the whole structure. A tensor
    whose ``dim`` is out of range is returned unchanged, and so is a nested (jagged) tensor,
    with a :class:`CannotPadNestedTensorWarning`.

    Args:
        tensor: a tensor or nested tuples/lists/mappings of tensors, of the same structure and
            number of dimensions on every process.
        dim: the dimension to pad (negative counts from the end).
        pad_index: the fill value.
        pad_first: pad at the start instead of the end.

    Returns:
        The same structure with padded tensors (the inputs themselves where nothing is padded).

    Raises:
        TypeError: a leaf is not a tensor.
        DistributedOperationException: the processes' structures or numbers of dimensions
            differ.
    """
    world_size = _world_size()
    if world_size == 1:  # nothing to pad to; a nested tensor is still named, as Accelerate's
        return recursively_apply(_warn_if_nested, tensor, error_on_other_type=True)
    _validate_tensors(tensor, "pad_across_processes")
    shapes: list[list[int] | None] = []
    recursively_apply(lambda t: shapes.append(None if t.is_nested else list(t.shape)), tensor)
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, shapes)
    if any(len(other) != len(shapes) for other in everyone) or any(
        [len(s or ()) for s in other] != [len(s or ()) for s in shapes] for other in everyone
    ):
        lines = "\n".join(f"  rank {r}: {s}" for r, s in enumerate(everyone))
        raise DistributedOperationException(
            "pad_across_processes needs the same structure and number of dimensions on every "
            f"process; got tensor shapes:\n{lines}"
        )
    leaf = iter(range(len(shapes)))

    def pad_one(t: torch.Tensor) -> torch.Tensor:
        index = next(leaf)
        if t.is_nested:
            return _warn_if_nested(t, stacklevel=5)
        if not -t.dim() <= dim < t.dim():
            return t
        axis = dim % t.dim()
        longest = max(other[index][axis] for other in everyone if other[index] is not None)
        if longest == t.shape[axis]:
            return t
        size = list(t.shape)
        size[axis] = longest
        padded = t.new_full(size, pad_index)
        start = longest - t.shape[axis] if pad_first else 0
        padded.narrow(axis, start, t.shape[axis]).copy_(t)
        return padded

    return recursively_apply(pad_one, tensor, error_on_other_type=True)


def _warn_if_nested(t: torch.Tensor, stacklevel: int = 4) -> torch.Tensor:
    # stacklevel: the user's call of pad_across_processes, through recursively_apply.
    if t.is_nested:
        warnings.warn(
            "cannot pad a nested tensor without more information; left unpadded",
            CannotPadNestedTensorWarning,
            stacklevel=stacklevel,
        )
    return t

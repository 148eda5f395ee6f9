"""Apply functions to nested tuples, lists and mappings of tensors (Accelerate's helpers).

"Nested data" below is a tensor, or a ``tuple``/``list`` (namedtuples included) or
``Mapping`` of nested data; containers are rebuilt with their own type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "concatenate",
    "convert_to_fp32",
    "find_batch_size",
    "find_device",
    "get_shape",
    "honor_type",
    "ignorant_find_batch_size",
    "is_namedtuple",
    "is_torch_tensor",
    "listify",
    "recursively_apply",
    "send_to_device",
    "slice_tensors",
]


def is_torch_tensor(tensor: Any) -> bool:
    """``isinstance(tensor, torch.Tensor)``."""
    return isinstance(tensor, torch.Tensor)


def is_namedtuple(data: Any) -> bool:
    """True for an instance of a ``collections.namedtuple`` / ``typing.NamedTuple`` class."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj: Sequence[Any], generator: Iterable[Any]) -> Any:
    """Build a container of ``obj``'s type (list, tuple or namedtuple) from ``generator``."""
    if is_namedtuple(obj):
        return type(obj)(*generator)
    return type(obj)(generator)  # type: ignore[call-arg]


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Return ``data`` with ``func(leaf, *args, **kwargs)`` in place of each leaf for which
    ``test_type(leaf)`` is true.

    Args:
        func: applied to each matching leaf.
        data: nested tuples/lists/mappings.
        test_type: which leaves ``func`` applies to (default: tensors).
        error_on_other_type: raise on a leaf that is neither a container nor matched, instead
            of keeping it unchanged.

    Raises:
        TypeError: ``error_on_other_type`` and a leaf of another type (the message names its
            type and ``func``).
    """
    if isinstance(data, (tuple, list)):
        return honor_type(
            data,
            (
                recursively_apply(
                    func,
                    item,
                    *args,
                    test_type=test_type,
                    error_on_other_type=error_on_other_type,
                    **kwargs,
                )
                for item in data
            ),
        )
    if isinstance(data, Mapping):
        return type(data)(  # type: ignore[call-arg]
            {
                key: recursively_apply(
                    func,
                    value,
                    *args,
                    test_type=test_type,
                    error_on_other_type=error_on_other_type,
                    **kwargs,
                )
                for key, value in data.items()
            }
        )
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        name = getattr(func, "__name__", repr(func))
        raise TypeError(
            f"unsupported type {type(data).__name__} passed to {name}: only nested "
            f"lists/tuples/dicts of objects accepted by {test_type.__name__} are"
        )
    return data


def send_to_device(
    tensor: Any,
    device: torch.device | str | int,
    non_blocking: bool = False,
    skip_keys: str | Sequence[str] | None = None,
) -> Any:
    """Move every tensor (and every object with a ``.to`` method) in nested data to ``device``.

    Args:
        tensor: nested data; other leaves are returned unchanged.
        device: the target device.
        non_blocking: passed to ``.to`` (asynchronous copies from pinned memory).
        skip_keys: mapping keys whose values stay where they are.
    """
    if isinstance(tensor, torch.Tensor) or (
        hasattr(tensor, "to") and not isinstance(tensor, (Mapping, tuple, list))
    ):
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:  # a .to() without non_blocking
            return tensor.to(device)
    if isinstance(tensor, (tuple, list)):
        return honor_type(
            tensor,
            (send_to_device(t, device, non_blocking, skip_keys) for t in tensor),
        )
    if isinstance(tensor, Mapping):
        skipped = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys or ())
        return type(tensor)(  # type: ignore[call-arg]
            {
                key: value
                if key in skipped
                else send_to_device(value, device, non_blocking, skip_keys)
                for key, value in tensor.items()
            }
        )
    return tensor


def get_shape(data: Any) -> Any:
    """``data`` with each tensor replaced by its shape as a list of ints."""
    return recursively_apply(lambda t: list(t.shape), data)


def find_batch_size(data: Any) -> int:
    """The size of dimension 0 of the first tensor in ``data`` (depth first).

    Raises:
        ValueError: an empty container on the way.
        TypeError: the first leaf is not a tensor.
    """
    if isinstance(data, (tuple, list, Mapping)) and len(data) == 0:
        raise ValueError(f"cannot find the batch size of an empty {type(data).__name__}")
    if isinstance(data, (tuple, list)):
        return find_batch_size(data[0])
    if isinstance(data, Mapping):
        return find_batch_size(next(iter(data.values())))
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"can only find the batch size of tensors, got {type(data).__name__}")
    return int(data.shape[0])


def ignorant_find_batch_size(data: Any) -> int | None:
    """:func:`find_batch_size`, or ``None`` where it raises."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor in ``data`` (depth first), ``None`` if it has none."""
    if isinstance(data, torch.Tensor):
        return data.device
    values = data.values() if isinstance(data, Mapping) else data
    if isinstance(data, (Mapping, tuple, list)):
        for item in values:
            device = find_device(item)
            if device is not None:
                return device
    return None


def listify(data: Any) -> Any:
    """``data`` with each tensor replaced by ``tensor.tolist()`` (bfloat16 read as float32)."""

    def to_list(tensor: torch.Tensor) -> Any:
        tensor = tensor.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.float()
        return tensor.tolist()

    return recursively_apply(to_list, data)


def slice_tensors(
    data: Any,
    tensor_slice: slice | int | tuple[Any, ...],
    process_index: int | None = None,
    num_processes: int | None = None,
) -> Any:
    """``data`` with each tensor replaced by ``tensor[tensor_slice]``. ``process_index`` and
    ``num_processes`` are accepted and unused, as in Accelerate (whose XLA path once read
    them)."""
    return recursively_apply(lambda t: t[tensor_slice], data)


def concatenate(data: Sequence[Any], dim: int = 0) -> Any:
    """Concatenate a list of equally structured nested data along ``dim``, leaf by leaf.

    Raises:
        TypeError: the leaves are not tensors (and there is more than one element).
    """
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(
            first, (concatenate([d[i] for d in data], dim) for i in range(len(first)))
        )
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim) for k in first})  # type: ignore[call-arg]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(data), dim=dim)
    if len(data) == 1:
        return first
    raise TypeError(f"can only concatenate tensors, got {type(first).__name__}")


def convert_to_fp32(tensor: Any) -> Any:
    """``tensor`` with every float16/bfloat16 tensor converted to float32."""
    return recursively_apply(
        lambda t: t.float(),
        tensor,
        test_type=lambda t: (
            isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16)
        ),
    )

"""Apply functions to nested tuples, lists and mappings of tensors (Accelerate's helpers).

"Nested data" below is a tensor, or a ``tuple``/``list`` (namedtuples included) or
``Mapping`` of nested data; containers are rebuilt with their own type.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "concatenate",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "find_batch_size",
    "find_device",
    "get_shape",
    "honor_type",
    "ignorant_find_batch_size",
    "is_namedtuple",
    "is_torch_tensor",
    "listify",
    "pad_input_tensors",
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
        TypeError: ``error_on_other_type`` and a leaf of another type (Accelerate's message,
            naming its type and ``func``).
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
        raise TypeError(  # Accelerate's message, word for word (its tests compare it)
            f"Unsupported types ({type(data)}) passed to `{name}`. Only nested "
            f"list/tuple/dicts of objects that are valid for `{test_type.__name__}` should be "
            "passed."
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


class _Fp32Outputs:
    """The callable :func:`convert_outputs_to_fp32` wraps: ``convert_to_fp32`` of the wrapped
    function's result. Accelerate's refuses to pickle (a model whose forward it is must be
    unwrapped first); this one pickles when the wrapped function does (a model's bound
    ``forward`` does), so a model carrying it saves with ``torch.save``/``pickle``."""

    __wrapped__: Callable[..., Any]

    def __init__(self, model_forward: Callable[..., Any]) -> None:
        functools.update_wrapper(self, model_forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(self.__wrapped__(*args, **kwargs))

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the wrapped function alone (update_wrapper's copies follow from it).
        return (type(self), (self.__wrapped__,))


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``model_forward`` so that its float16/bfloat16 outputs come back as float32
    (:func:`convert_to_fp32` of its result): Accelerate's decorator for a model's forward.

    The result keeps ``model_forward``'s name, docstring and signature
    (``functools.update_wrapper``; ``__wrapped__`` is ``model_forward``) and pickles when
    ``model_forward`` does (Accelerate's raises ``pickle.PicklingError``).
    """
    return _Fp32Outputs(model_forward)


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Pad every tensor of nested data with zero rows so that its first dimension can be split
    over ``num_processes`` (Accelerate's, with its sizes: ``batch_size + to_pad`` rows where
    ``to_pad`` is ``num_processes - batch_size // num_processes``, or ``num_processes -
    batch_size`` for a batch smaller than ``num_processes``; ``tensor[:batch_size]`` is the
    input, the new rows are zeros, ``Tensor.new_zeros``).

    Args:
        tensor: nested data of tensors (any other leaf is a ``TypeError``).
        batch_size: the number of samples in the batch (``tensor.shape[dim]``).
        num_processes: the number of processes the batch is split over.
        dim: the dimension the input is copied along (the padded one is always 0, as
            Accelerate's).
    """

    def _pad(t: torch.Tensor, batch_size: int, num_processes: int, dim: int = 0) -> torch.Tensor:
        per_process = batch_size // num_processes
        last_inputs = batch_size - per_process * num_processes
        to_pad = num_processes - batch_size if per_process == 0 else num_processes - per_process
        if last_inputs > to_pad and to_pad < 1:  # Accelerate's rare negative case
            to_pad = last_inputs - to_pad
        new_size = list(t.shape)
        new_size[0] = batch_size + to_pad
        padded = t.new_zeros(tuple(new_size))
        index = tuple(slice(0, t.shape[dim]) if i == dim else slice(None) for i in range(t.dim()))
        padded[index] = t
        return padded

    return recursively_apply(
        _pad,
        tensor,
        error_on_other_type=True,
        batch_size=batch_size,
        num_processes=num_processes,
        dim=dim,
    )

"""Accelerate's keywords that have no kwplug counterpart to reach: each is accepted where
Accelerate accepts it and either does what Accelerate's does here or tells the user, with a
``KwplugWarning`` or an error at the call, what kwplug does instead (never different numbers
in silence). The ``Accelerator`` methods call these checks before delegating."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from kwplug.errors import KwplugWarning

#: ``load_state(map_location=...)`` values Accelerate accepts.
MAP_LOCATIONS = ("cpu", "on_device")


def check_save_state(safe_serialization: Any, save_model_func_kwargs: Mapping[str, Any]) -> None:
    """``save_state(safe_serialization=..., **save_model_func_kwargs)``.

    kwplug writes every checkpoint file as safetensors (plus JSON), so
    ``safe_serialization=False`` (Accelerate: pickled ``pytorch_model.bin``) saves the same
    tensors as safetensors, with a warning. Accelerate passes ``save_model_func_kwargs`` only to
    DeepSpeed's ``save_checkpoint`` and ignores them otherwise; kwplug has no DeepSpeed engine,
    so it ignores them too, with a warning naming them.

    Raises:
        TypeError: ``safe_serialization`` is not a ``bool``.
    """
    if not isinstance(safe_serialization, bool):
        raise TypeError(
            f"save_state(safe_serialization=...) must be a bool, got "
            f"{type(safe_serialization).__name__}"
        )
    if not safe_serialization:
        warnings.warn(
            "save_state(safe_serialization=False): kwplug writes checkpoints only as "
            "safetensors (it never pickles); the checkpoint is saved as safetensors and "
            "load_state() reads it as usual",
            KwplugWarning,
            stacklevel=3,
        )
    if save_model_func_kwargs:
        warnings.warn(
            f"save_state() ignores {sorted(save_model_func_kwargs)}: Accelerate passes these "
            "keywords only to DeepSpeed's save_checkpoint (and ignores them without DeepSpeed); "
            "kwplug has no DeepSpeed engine",
            KwplugWarning,
            stacklevel=3,
        )


def check_load_state(
    load_kwargs: Mapping[str, Any] | None, load_model_func_kwargs: Mapping[str, Any]
) -> None:
    """``load_state(load_kwargs=..., **load_model_func_kwargs)``.

    - ``load_kwargs`` are Accelerate's ``torch.load`` keywords; kwplug never unpickles (every
      file is safetensors or JSON), so non-empty ones are ignored with a warning.
    - ``map_location`` (``"cpu"`` or ``"on_device"``, Accelerate's values): accepted; both
      load into the prepared objects in place, so the tensors end where those objects are (in
      Accelerate too: ``load_state_dict`` copies into the parameters, and the optimizer casts
      its state to its parameters' devices).
    - ``strict=True`` (the model's ``load_state_dict``) is what kwplug always does; ``False``
      is refused: kwplug loads a checkpoint only into the same prepared objects, after
      checking every key and shape.
    - anything else is a ``TypeError``, as Accelerate's model loader raises for it.

    Raises:
        TypeError: ``load_kwargs`` is not a mapping; an unknown keyword.
        ValueError: ``map_location`` not ``"cpu"``/``"on_device"``/``None``; ``strict=False``.
    """
    if load_kwargs is not None and not isinstance(load_kwargs, Mapping):
        raise TypeError(f"load_state(load_kwargs=...) must be a dict, got {type(load_kwargs)}")
    if load_kwargs:
        warnings.warn(
            f"load_state() ignores load_kwargs {sorted(load_kwargs)}: they are torch.load "
            "keywords, and kwplug never unpickles (every file is safetensors or JSON)",
            KwplugWarning,
            stacklevel=3,
        )
    extra = dict(load_model_func_kwargs)
    location = extra.pop("map_location", None)
    if location is not None and location not in MAP_LOCATIONS:
        raise ValueError(
            f"load_state(map_location=...) must be one of {MAP_LOCATIONS} or None, got {location!r}"
        )
    strict = extra.pop("strict", True)
    if strict is not True:
        raise ValueError(
            f"load_state(strict={strict!r}) is not supported: kwplug loads a checkpoint only "
            "into the same prepared models (every key and shape is checked); strict=True only"
        )
    if extra:
        raise TypeError(
            f"load_state() got unexpected keyword arguments {sorted(extra)} (accepted: "
            "input_dir, load_kwargs, map_location, strict)"
        )


def device_placements(device_placement: Sequence[bool | None] | None, count: int) -> list[Any]:
    """``prepare(*args, device_placement=[...])``: one entry per object, ``None`` meaning the
    Accelerator's ``device_placement``.

    Raises:
        TypeError: ``device_placement`` is not a list or tuple, or holds something else than
            ``bool``/``None``.
        ValueError: its length is not the number of objects (as Accelerate).
    """
    if device_placement is None:
        return [None] * count
    if not isinstance(device_placement, (list, tuple)):
        raise TypeError(
            f"prepare(device_placement=...) must be a list of bool, got "
            f"{type(device_placement).__name__}"
        )
    if len(device_placement) != count:
        raise ValueError(
            f"`device_placement` should be a list with {count} elements (the number of objects "
            f"passed), got {len(device_placement)}"
        )
    for value in device_placement:
        if value is not None and not isinstance(value, bool):
            raise TypeError(
                f"prepare(device_placement=...) holds {value!r}; accepted: True, False, None"
            )
    return list(device_placement)


def check_bool(name: str, value: Any) -> bool:
    """``value`` when it is a ``bool``; else a ``TypeError`` naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value

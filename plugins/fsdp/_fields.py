"""Converters and validators of ``FullyShardedDataParallelPlugin``'s fields.

Each field follows Accelerate 1.16's ``FullyShardedDataParallelPlugin.__post_init__`` for
``fsdp_version=2``: ``None`` reads the same ``FSDP_*`` environment variable (what
``accelerate launch --use_fsdp`` and its config files set), then Accelerate's default. What
kwplug does not do (FSDP1, its sharding strategies and prefetch options) is a ``ValueError``
naming the field and what it accepts, raised when the plugin is constructed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import torch

from kwplug.utils.environment import str_to_bool
from kwplug.validators import shown

#: Accelerate's auto-wrap policy names (``FSDP_AUTO_WRAP_POLICY``), as kwplug stores them.
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
#: The state dict types FSDP2 has (``FSDP_STATE_DICT_TYPE``); FSDP1's ``LOCAL_STATE_DICT`` is not.
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
#: Accelerate's ``set_mixed_precision`` names -> the dtype (``"fp8"``: bfloat16, as Accelerate).
PRECISIONS: dict[str, torch.dtype] = {
    "fp8": torch.bfloat16,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}


def env_flag(name: str, value: Any) -> Any:
    """``value``, or for ``None`` the boolean environment variable ``FSDP_<name>`` (default
    false), as Accelerate's ``str_to_bool(os.environ.get(...)) == 1``."""
    if value is None:
        return str_to_bool(os.environ.get("FSDP_" + name, "False")) == 1
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` when it is a ``bool``; else ``TypeError`` naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(
            f"FullyShardedDataParallelPlugin.{name} must be a bool, got {shown(value)} of type "
            f"{type(value).__name__}"
        )
    return value


def fsdp_version(value: Any) -> int:
    """2 (``None``: ``FSDP_VERSION``, else 2). FSDP1 is not part of kwplug."""
    if value is None:
        value = os.environ.get("FSDP_VERSION", "2")
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value != 2 or isinstance(value, bool):
        raise ValueError(
            f"FullyShardedDataParallelPlugin.fsdp_version must be 2 (torch's fully_shard, FSDP2), "
            f"got {shown(value)}: kwplug does not wrap models in FSDP1's FullyShardedDataParallel"
        )
    return 2


def reshard_after_forward(value: Any) -> bool:
    """A bool (``None``: ``FSDP_RESHARD_AFTER_FORWARD``, default ``"true"``; a string is read as
    Accelerate's ``str_to_bool``)."""
    if value is None:
        value = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true")
    if isinstance(value, str):
        try:
            return bool(str_to_bool(value.lower(), to_bool=True))
        except ValueError:
            raise ValueError(
                "FullyShardedDataParallelPlugin.reshard_after_forward must be a bool (or "
                f"'true'/'false'); FSDP1's sharding strategy names are not accepted, got "
                f"{shown(value)}"
            ) from None
    return check_bool("reshard_after_forward", value)


def must_be_unset(name: str, value: Any, accepted: tuple[Any, ...], why: str) -> Any:
    """``value`` if it is one of ``accepted`` (compared with ``is`` for ``None``/bools),
    else ``ValueError`` naming the field and saying ``why``."""
    if any(value is ok or (type(value) is type(ok) and value == ok) for ok in accepted):
        return value
    shown_ok = " or ".join(map(repr, accepted))
    raise ValueError(
        f"FullyShardedDataParallelPlugin.{name} must be {shown_ok}, got {shown(value)}: {why}"
    )


def backward_prefetch(value: Any) -> None:
    """``None`` (``"NO_PREFETCH"`` too): FSDP2 prefetches on its own."""
    if value is None:
        value = os.environ.get("FSDP_BACKWARD_PREFETCH")
    if isinstance(value, str) and value.upper() == "NO_PREFETCH":
        value = None
    must_be_unset(
        "backward_prefetch",
        value,
        (None, "NO_PREFETCH"),
        "FSDP1's BackwardPrefetch; FSDP2 (fully_shard) prefetches the next group itself",
    )
    return None


def mixed_precision_policy(value: Any) -> Any:
    """``None``, or a ``torch.distributed.fsdp.MixedPrecisionPolicy`` built from a name
    (``"bf16"``, ``"fp16"``, ``"fp32"``, ``"fp8"``: ``param_dtype`` and ``reduce_dtype`` both
    that dtype, as Accelerate's ``set_mixed_precision``), a ``dict`` with ``param_dtype`` and
    ``reduce_dtype`` (torch dtypes), or such a policy itself."""
    if value is None:  # no import: torch.distributed.fsdp costs ~1 s, paid only when used
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    wanted = (
        f"None, one of {', '.join(map(repr, PRECISIONS))}, a dict with keys 'param_dtype' and "
        "'reduce_dtype' (torch.float16/bfloat16/float32), or a "
        "torch.distributed.fsdp.MixedPrecisionPolicy"
    )
    if value is None or isinstance(value, MixedPrecisionPolicy):
        return value
    if isinstance(value, str):
        if value not in PRECISIONS:
            raise ValueError(
                f"FullyShardedDataParallelPlugin.mixed_precision_policy must be {wanted}, "
                f"got {shown(value)}"
            )
        dtype = PRECISIONS[value]
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    if isinstance(value, dict):
        dtypes = set(PRECISIONS.values())
        keys = {"param_dtype", "reduce_dtype"}
        if set(value) != keys or any(v not in dtypes for v in value.values()):
            raise ValueError(
                f"FullyShardedDataParallelPlugin.mixed_precision_policy must be {wanted}, "
                f"got {shown(value)}"
            )
        return MixedPrecisionPolicy(**value)
    raise TypeError(
        f"FullyShardedDataParallelPlugin.mixed_precision_policy must be {wanted}, got "
        f"{shown(value)} of type {type(value).__name__}"
    )


def auto_wrap_policy(value: Any) -> str | Callable[[torch.nn.Module], bool]:
    """One of :data:`WRAP_POLICIES` (``None``: ``FSDP_AUTO_WRAP_POLICY``, default
    ``"NO_WRAP"``; torch's ``transformer_auto_wrap_policy``/``size_based_auto_wrap_policy``
    functions, or ``functools.partial`` of them, by their name), or a callable
    ``policy(module) -> bool`` choosing the submodules sharded on their own."""
    if value is None:
        value = os.environ.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP")
    size_based: object = None
    by_class: object = None
    if not isinstance(value, str):  # a callable: torch's policies are recognised by identity
        from torch.distributed.fsdp import wrap

        size_based, by_class = wrap.size_based_auto_wrap_policy, wrap.transformer_auto_wrap_policy
    function = getattr(value, "func", value)  # a functools.partial of torch's policies
    if function is by_class:
        return "TRANSFORMER_BASED_WRAP"
    if function is size_based:
        return "SIZE_BASED_WRAP"
    if isinstance(value, str):
        if value.upper() not in WRAP_POLICIES:
            raise ValueError(
                "FullyShardedDataParallelPlugin.auto_wrap_policy must be one of "
                f"{', '.join(map(repr, WRAP_POLICIES))} (any case), a callable "
                f"policy(module) -> bool or None, got {shown(value)}"
            )
        return value.upper()
    if callable(value):
        policy: Callable[[torch.nn.Module], bool] = value
        return policy
    raise TypeError(
        "FullyShardedDataParallelPlugin.auto_wrap_policy must be a str, a callable "
        f"policy(module) -> bool or None, got {shown(value)} of type {type(value).__name__}"
    )


def class_names(value: Any, policy: Any) -> list[str] | None:
    """The ``transformer_cls_names_to_wrap`` list (a comma-separated string is split; ``None``
    with the transformer policy: ``FSDP_TRANSFORMER_CLS_TO_WRAP``, else the model's
    ``_no_split_modules`` at ``prepare``)."""
    if value is None and policy == "TRANSFORMER_BASED_WRAP":
        value = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
    if value is None:
        return None
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise TypeError(
            "FullyShardedDataParallelPlugin.transformer_cls_names_to_wrap must be None, a "
            "comma-separated str or a list of class names (str), got "
            f"{shown(value)} of type {type(value).__name__}"
        )
    return [v.strip() for v in value]


def min_num_params(value: Any, policy: Any) -> int | None:
    """An int >= 0 (``None`` with the size-based policy: ``FSDP_MIN_NUM_PARAMS``, default 0)."""
    if value is None and policy == "SIZE_BASED_WRAP":
        raw = os.environ.get("FSDP_MIN_NUM_PARAMS", "0")
        if not raw.strip().isdigit():
            raise ValueError(
                "FullyShardedDataParallelPlugin.min_num_params (from FSDP_MIN_NUM_PARAMS) must "
                f"be an int >= 0, got {shown(raw)}"
            )
        value = int(raw)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            "FullyShardedDataParallelPlugin.min_num_params must be an int >= 0, got "
            f"{shown(value)} of type {type(value).__name__}"
        )
    if value < 0:
        raise ValueError(f"FullyShardedDataParallelPlugin.min_num_params must be >= 0, got {value}")
    return value


def cpu_offload(value: Any) -> Any:
    """A ``torch.distributed.fsdp.OffloadPolicy``: ``True`` -> ``CPUOffloadPolicy()``,
    ``False`` -> ``None`` (no offload: ``fully_shard``'s default ``OffloadPolicy()``); ``None``:
    ``FSDP_OFFLOAD_PARAMS``. ``False`` needs no import of ``torch.distributed.fsdp`` (~1 s):
    a default handler, which discovery builds in every process, stays cheap."""
    value = env_flag("OFFLOAD_PARAMS", value)
    if value is False:
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if isinstance(value, OffloadPolicy):
        return value
    if isinstance(value, bool):
        return CPUOffloadPolicy() if value else OffloadPolicy()
    raise TypeError(
        "FullyShardedDataParallelPlugin.cpu_offload must be a bool, None or a "
        "torch.distributed.fsdp.OffloadPolicy (CPUOffloadPolicy), got "
        f"{shown(value)} of type {type(value).__name__}"
    )


def state_dict_type(value: Any) -> str:
    """``"FULL_STATE_DICT"`` or ``"SHARDED_STATE_DICT"`` (any case, or torch's
    ``StateDictType`` member); ``None``: ``FSDP_STATE_DICT_TYPE``, default
    ``"SHARDED_STATE_DICT"`` (Accelerate's FSDP2 default)."""
    if value is None:
        value = os.environ.get("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT")
    name = getattr(value, "name", value)  # torch.distributed.fsdp.StateDictType
    if isinstance(name, str) and name.upper() in STATE_DICT_TYPES:
        return name.upper()
    raise ValueError(
        "FullyShardedDataParallelPlugin.state_dict_type must be one of "
        f"{', '.join(map(repr, STATE_DICT_TYPES))} (FSDP2 has no LOCAL_STATE_DICT), got "
        f"{shown(value)}"
    )


def ignored_modules(value: Any) -> Any:
    """``None``, a regular expression (str) matched against module names, or an iterable of
    ``torch.nn.Module``; ``None``: ``FSDP_IGNORED_MODULES``."""
    if value is None:
        value = os.environ.get("FSDP_IGNORED_MODULES")
    if isinstance(value, str):
        try:  # matched against module names at prepare: a bad pattern is refused here
            re.compile(value)
        except re.error as exc:
            raise ValueError(
                "FullyShardedDataParallelPlugin.ignored_modules must be a valid regular "
                f"expression over module names, got {shown(value)}: {exc}"
            ) from None
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, torch.nn.Module):
        return [value]
    try:
        items = list(value)
    except TypeError:
        items = None
    if items is None or not all(isinstance(m, torch.nn.Module) for m in items):
        raise TypeError(
            "FullyShardedDataParallelPlugin.ignored_modules must be None, a regular expression "
            "(str) over module names or an iterable of torch.nn.Module, got "
            f"{shown(value)} of type {type(value).__name__}"
        )
    return items


def state_dict_config(name: str, value: Any, kind: str, optim: bool) -> Any:
    """``value`` when it is torch's ``StateDictConfig`` (``OptimStateDictConfig`` for
    ``optim``); ``None``: Accelerate's default for ``kind`` (``FULL_STATE_DICT``:
    ``Full[Optim]StateDictConfig(offload_to_cpu=True, rank0_only=True)``, else
    ``Sharded[Optim]StateDictConfig(offload_to_cpu=True)``). FSDP2 reads its ``offload_to_cpu``
    and ``rank0_only`` (``StateDictOptions(cpu_offload=, broadcast_from_rank0=)``).
    ``None`` with a sharded ``kind`` stays ``None`` (that default, read as
    ``offload_to_cpu=True``), so that a default handler needs no ``torch.distributed.fsdp``."""
    if value is None and kind != "FULL_STATE_DICT":
        return None
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        OptimStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictConfig,
    )

    base = OptimStateDictConfig if optim else StateDictConfig
    if value is None:
        if kind == "FULL_STATE_DICT":
            full = FullOptimStateDictConfig if optim else FullStateDictConfig
            return full(offload_to_cpu=True, rank0_only=True)
        sharded = ShardedOptimStateDictConfig if optim else ShardedStateDictConfig
        return sharded(offload_to_cpu=True)
    if not isinstance(value, base):
        raise TypeError(
            f"FullyShardedDataParallelPlugin.{name} must be None or a "
            f"torch.distributed.fsdp.{base.__name__}, got {shown(value)} of type "
            f"{type(value).__name__}"
        )
    return value

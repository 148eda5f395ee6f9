"""Sharding one model with FSDP2, as Accelerate 1.16's ``fsdp2_prepare_model`` does.

In order: activation checkpointing on the auto-wrap policy's modules (``torch.utils.checkpoint``
around their ``forward``, so parameter names stay the user's), low-precision trainable
parameters upcast to float32 under mixed precision, ``fully_shard`` on each module the policy
selects (children before parents), then on the root; with ``cpu_ram_efficient_loading``
rank 0's weights are broadcast into the shards
(``torch.distributed.checkpoint.state_dict.set_model_state_dict(broadcast_from_rank0=True)``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class ShardSettings(Protocol):
    """The fields of :class:`kwplug.plugins.fsdp.FullyShardedDataParallelPlugin` sharding
    reads (a protocol, so that this module does not import the handler that imports it)."""

    activation_checkpointing: bool | None
    activation_checkpointing_offload: bool | None
    auto_wrap_policy: Any
    cpu_offload: Any
    cpu_ram_efficient_loading: bool | None
    ignored_modules: Any
    min_num_params: int | None
    mixed_precision_policy: Any
    reshard_after_forward: bool | str | None
    transformer_cls_names_to_wrap: Any


Policy = Callable[[nn.Module], bool]

#: Accelerator(mixed_precision=...) -> the dtype of Accelerate's default FSDP2 policy.
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def bottom_up(model: nn.Module) -> list[nn.Module]:
    """Every module of ``model``, children before parents, each once; ``model`` last."""
    seen: set[int] = set()
    order: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        seen.add(id(module))
        for child in module.children():
            if id(child) not in seen:
                visit(child)
        order.append(module)

    visit(model)
    return order


def _class_named(model: nn.Module, name: str) -> type[nn.Module] | None:
    for module in model.modules():
        if type(module).__name__ == name:
            return type(module)
    return None


def wrap_policy(plugin: ShardSettings, model: nn.Module) -> Policy | None:
    """The predicate choosing the submodules sharded on their own (Accelerate's
    ``fsdp2_prepare_auto_wrap_policy``), or ``None`` for the root alone.

    Raises:
        ValueError: a name in ``transformer_cls_names_to_wrap`` is no class of ``model``.
    """
    policy = plugin.auto_wrap_policy
    if callable(policy):
        chosen: Policy = policy
        return chosen
    if policy == "TRANSFORMER_BASED_WRAP":
        names = plugin.transformer_cls_names_to_wrap
        if names is None:  # a transformers model's own list of layers not to split
            declared = getattr(model, "_no_split_modules", None) or []
            names = [n for n in declared if _class_named(model, n) is not None]
        classes = []
        for name in names:
            cls = _class_named(model, name)
            if cls is None:
                present = sorted({type(m).__name__ for m in model.modules()})
                raise ValueError(
                    f"FullyShardedDataParallelPlugin.transformer_cls_names_to_wrap: {name!r} is "
                    f"no module class of {type(model).__name__}; its classes are {present}"
                )
            classes.append(cls)
        found = tuple(classes)
        return lambda module: bool(found) and isinstance(module, found)
    if policy == "SIZE_BASED_WRAP":
        least = plugin.min_num_params or 0
        return lambda module: sum(p.numel() for p in module.parameters()) > least
    return None


class _Checkpointed:
    """A module's ``forward`` recomputed in backward (``torch.utils.checkpoint``,
    non-reentrant), its saved inputs on the CPU with ``offload``."""

    def __init__(self, forward: Callable[..., Any], offload: bool) -> None:
        self.forward = forward
        self.offload = offload

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        saving = torch.autograd.graph.save_on_cpu() if self.offload else contextlib.nullcontext()
        with saving:
            return torch.utils.checkpoint.checkpoint(
                self.forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs
            )


def apply_activation_checkpointing(model: nn.Module, policy: Policy | None, offload: bool) -> int:
    """Checkpoint each submodule ``policy`` selects; returns how many.

    Raises:
        ValueError: no auto-wrap policy (nothing says which layers to checkpoint).
    """
    if policy is None:
        raise ValueError(
            "FullyShardedDataParallelPlugin.activation_checkpointing needs an auto_wrap_policy "
            "('transformer_based_wrap', 'size_based_wrap' or a callable) to choose the layers"
        )
    count = 0
    for module in bottom_up(model)[:-1]:
        if policy(module) and not isinstance(module.forward, _Checkpointed):
            module.forward = _Checkpointed(module.forward, offload)
            count += 1
    return count


def _ignored(plugin: ShardSettings, model: nn.Module) -> set[nn.Parameter]:
    chosen = plugin.ignored_modules
    if chosen is None:
        return set()
    if isinstance(chosen, str):
        pattern = re.compile(chosen)
        modules = [m for name, m in model.named_modules() if pattern.fullmatch(name)]
    else:
        modules = list(chosen)
    return {p for module in modules for p in module.parameters()}


def precision_policy(plugin: ShardSettings, mixed_precision: str) -> Any:
    """The plugin's ``MixedPrecisionPolicy``, else Accelerate's default for the Accelerator's
    ``mixed_precision``: ``param_dtype`` and ``reduce_dtype`` both bfloat16 (``"bf16"``) or
    float16 (``"fp16"``); none for ``"no"``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if plugin.mixed_precision_policy is not None:
        return plugin.mixed_precision_policy
    dtype = _DTYPES.get(mixed_precision)
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)


def shard(
    plugin: ShardSettings,
    model: nn.Module,
    mesh: DeviceMesh,
    mixed_precision: str,
) -> nn.Module:
    """Shard ``model`` in place over ``mesh`` (1-D: FSDP; 2-D ``(replicate, shard)``: HSDP)
    and return it, now a ``torch.distributed.fsdp.FSDPModule``.

    Raises:
        ValueError: see :func:`wrap_policy`, :func:`apply_activation_checkpointing`.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(model, FSDPModule):  # prepared before (e.g. once for evaluation)
        return model
    policy = wrap_policy(plugin, model)
    if plugin.activation_checkpointing:
        apply_activation_checkpointing(model, policy, bool(plugin.activation_checkpointing_offload))
    if mixed_precision != "no":  # FSDP2 wants float32 masters; the policy casts for compute
        for param in model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.to(torch.float32)
    rank0_weights = model.state_dict() if plugin.cpu_ram_efficient_loading else None
    options: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": precision_policy(plugin, mixed_precision),
    }
    if plugin.cpu_offload is not None:  # None: fully_shard's own default, no offload
        options["offload_policy"] = plugin.cpu_offload
    ignored = _ignored(plugin, model)
    if ignored:
        options["ignored_params"] = ignored
    if policy is not None:
        for module in bottom_up(model)[:-1]:
            if not isinstance(module, FSDPModule) and policy(module):
                fully_shard(
                    module, reshard_after_forward=bool(plugin.reshard_after_forward), **options
                )
    # The root with torch's own default (False for the root), as Accelerate.
    fully_shard(model, **options)
    if rank0_weights is not None:
        _broadcast_rank0(model, rank0_weights, mesh)
    return model


def _broadcast_rank0(model: nn.Module, weights: dict[str, Any], mesh: DeviceMesh) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # Only rank 0's full weights count: every other rank receives its shards from it.
    mine = weights if torch.distributed.get_rank() == 0 else {}
    set_model_state_dict(
        model, mine, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )


@contextlib.contextmanager
def gradient_sync_off(model: Any) -> Iterator[None]:
    """FSDP2's ``no_sync``: ``set_requires_gradient_sync(False)``, restored on exit."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)

"""Checkpoints of sharded models: full state dicts through ``torch.distributed.checkpoint``.

A model whose parameters are ``DTensor`` shards (FSDP2's ``fully_shard``) cannot be saved with
``model.state_dict()`` on rank 0: each rank holds only its shards. kwplug saves it as its
*full* state dict, gathered with ``torch.distributed.checkpoint.state_dict``
(``get_model_state_dict`` / ``get_optimizer_state_dict`` with
``StateDictOptions(full_state_dict=True, cpu_offload=True)``), so the model file has the same
keys and shapes as the unsharded model's ``state_dict()`` and loads without FSDP; the optimizer
file is torch's full optimizer state dict, keyed by parameter name. Loading reads the files on
rank 0 and broadcasts them (``set_*_state_dict(..., broadcast_from_rank0=True)``); each rank
keeps its own shards. Every function here that gathers or broadcasts is a collective: call it
on every rank, in the same order.

``torch.distributed.checkpoint.save`` (one file per rank, resharding on load) is not used:
its ``.metadata`` file is a pickle, and kwplug reads no pickle it did not allow-list.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from kwplug.optimizer import ScaledOptimizer


def is_sharded(module: torch.nn.Module) -> bool:
    """True when any parameter of ``module`` is a ``DTensor``."""
    # No DTensor exists unless torch.distributed.tensor was imported: do not import it here.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and any(isinstance(p, dtensor.DTensor) for p in module.parameters())


def optimizer_owners(
    modules: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer]
) -> dict[int, torch.nn.Module]:
    """Index of each optimizer that steps a sharded module's parameters -> that module.

    Args:
        modules: the prepared models, unwrapped.
        optimizers: the prepared optimizers.

    Raises:
        NotImplementedError: an optimizer steps a sharded module's parameters together with
            parameters outside it (torch's full optimizer state dict is per module).
    """
    owners: dict[int, torch.nn.Module] = {}
    for module in modules:
        if is_sharded(module):
            owners.update((id(p), module) for p in module.parameters())
    found: dict[int, torch.nn.Module] = {}
    if not owners:
        return found
    for i, optimizer in enumerate(optimizers):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        mine = {id(owners[id(p)]): owners[id(p)] for p in params if id(p) in owners}
        if not mine:
            continue
        if len(mine) > 1 or any(id(p) not in owners for p in params):
            raise NotImplementedError(
                f"checkpointing optimizer {i}: it steps parameters of a sharded model together "
                "with other parameters; give each sharded model its own optimizer"
            )
        found[i] = next(iter(mine.values()))
    return found


def _options(*, cpu_offload: bool = False, broadcast_from_rank0: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(
        full_state_dict=True, cpu_offload=cpu_offload, broadcast_from_rank0=broadcast_from_rank0
    )


def full_model_state(module: torch.nn.Module) -> dict[str, Any]:
    """The full state dict of sharded ``module`` (a collective; with ``cpu_offload`` only
    rank 0 gets the tensors, the others ``{}``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_options(cpu_offload=True))


def full_optimizer_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The full state dict of ``optimizer``, which steps sharded ``module`` (a collective;
    rank 0 gets it, the others ``{}``)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    options = _options(cpu_offload=True)
    return dict(get_optimizer_state_dict(module, torch_optimizer(optimizer), options=options))


def load_full_model(module: torch.nn.Module, state: dict[str, Any]) -> None:
    """Load the full state dict ``state`` (given on rank 0, ``{}`` elsewhere) into sharded
    ``module``; each rank keeps its own shards (a collective)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(module, state, options=_options(broadcast_from_rank0=True))


def load_full_optimizer(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load the full optimizer state dict ``state`` (given on rank 0, ``{}`` elsewhere) into
    ``optimizer``, which steps sharded ``module`` (a collective)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    # A stateless optimizer (plain SGD) has no tensor state, and torch's full-state-dict path
    # then fails ("Expected device to be set"): share its groups' hyperparameters and set
    # them as Optimizer.load_state_dict would.
    shared: list[Any] = [state["param_groups"] if state and not state.get("state") else None]
    if dist.is_initialized():
        dist.broadcast_object_list(shared, src=0)
    if shared[0] is not None:
        groups = torch_optimizer(optimizer).param_groups
        for live, saved in zip(groups, shared[0], strict=True):
            live.update({k: v for k, v in saved.items() if k != "params"})
        return
    options = _options(broadcast_from_rank0=True)
    set_optimizer_state_dict(module, torch_optimizer(optimizer), state, options=options)


def torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside a prepared one (what ``torch.distributed.checkpoint``'s
    ``get/set_optimizer_state_dict`` take)."""
    # torch.distributed.checkpoint works on the optimizer itself, not on the scaler's wrapper.
    return optimizer.optimizer if isinstance(optimizer, ScaledOptimizer) else optimizer

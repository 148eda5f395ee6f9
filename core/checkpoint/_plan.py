"""What a checkpoint holds: one entry per file, each an object with torch's ``Stateful``
protocol. To add something to checkpoints, add its entry in :func:`entries` (and, if it is
not ``Stateful`` already, an adapter in :mod:`kwplug.checkpoint._stateful`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import attrs
import torch

from kwplug.checkpoint import _dcp as dcp
from kwplug.checkpoint import _layout as layout
from kwplug.checkpoint import _sharded as sharded
from kwplug.checkpoint._accumulation import PendingAccumulation
from kwplug.checkpoint._checks import qualified_name
from kwplug.checkpoint._stateful import (
    RankState,
    ShardedModelState,
    ShardedOptimizerState,
    Stateful,
)
from kwplug.errors import CheckpointError

if TYPE_CHECKING:
    from kwplug.checkpoint._sources import CheckpointSources

#: ``main``: rank 0 saves and loads it; ``collective``: every rank takes part, rank 0 writes
#: the file and reads it (the others get ``{}``); ``each``: every rank its own file;
#: ``sharded``: every rank writes and reads its own shards (:mod:`kwplug.checkpoint._dcp`:
#: ``file`` is the prefix of the state's files).
Scope = Literal["main", "collective", "each", "sharded"]


@attrs.frozen
class Entry:
    """One file of a checkpoint and the object saved into it."""

    file: str
    target: Stateful
    scope: Scope
    kind: str  # module.Class of what is saved, stored with it (an optimizer's is checked)
    optional: bool = False  # loaded only when the file exists (the scaler: fp16 only)
    sparse: bool = False  # not written when its state is {}; loaded with {} when absent


def entries(sources: CheckpointSources) -> list[Entry]:
    """The files of the checkpoint of ``sources`` on this rank, in save and load order.

    Raises:
        NotImplementedError: an optimizer steps a sharded model's parameters together with
            parameters outside that model.
    """
    modules = sources.modules()
    owners = sharded.optimizer_owners(modules, sources.optimizers)
    plan: list[Entry] = []
    shards = dcp.state_dict_type(sources.state_dict_type) == dcp.SHARDED
    for i, module in enumerate(modules):
        if sharded.is_sharded(module) and shards:
            kind = qualified_name(module)
            plan.append(
                Entry(
                    layout.sharded_prefix("model", i), dcp.ModelShards(i, module), "sharded", kind
                )
            )
        elif sharded.is_sharded(module):
            target: Stateful = ShardedModelState(module)
            plan.append(Entry(layout.model_file(i), target, "collective", qualified_name(module)))
        else:
            plan.append(Entry(layout.model_file(i), module, "main", qualified_name(module)))
    for i, optimizer in enumerate(sources.optimizers):
        if i in owners and shards:
            target = dcp.OptimizerShards(i, owners[i], optimizer)
            kind = qualified_name(optimizer)
            plan.append(Entry(layout.sharded_prefix("optimizer", i), target, "sharded", kind))
        elif i in owners:
            target = ShardedOptimizerState(owners[i], optimizer)
            file = layout.optimizer_file(i)
            plan.append(Entry(file, target, "collective", qualified_name(optimizer)))
        else:
            file = layout.optimizer_file(i)
            plan.append(Entry(file, optimizer, "main", qualified_name(optimizer)))
    pending = PendingAccumulation(
        world_size=sources.num_processes,
        gradient_state=sources.gradient_state,
        modules=modules,
        optimizers=sources.optimizers,
        scaler_updates=sources.scaler_updates,
    )  # before the scaler: it makes the update the last step still owes
    file = layout.accumulation_file(sources.process_index)
    plan.append(Entry(file, pending, "each", qualified_name(pending), optional=True, sparse=True))
    if sources.scaler is not None:
        kind = qualified_name(sources.scaler)
        plan.append(Entry(layout.SCALER, sources.scaler, "main", kind, optional=True))
    for i, obj in enumerate(sources.custom_objects):
        plan.append(Entry(layout.custom_file(i), obj, "main", qualified_name(obj)))
    rank = RankState(
        world_size=sources.num_processes,
        device=sources.device,
        loaders=sources.dataloaders,
        process_index=sources.process_index,
        exact_positions=sources.exact_data_position,
        models=sources.models,
        collect_handlers=sources.handler_state,
        restore_handlers=sources.load_handler_state,
    )
    file = layout.rank_file(sources.process_index)
    plan.append(Entry(file, rank, "each", qualified_name(rank)))
    return plan


def _owner(optimizer: torch.optim.Optimizer, modules: list[torch.nn.Module]) -> Any:
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    return next((m for m in modules if any(p is first for p in m.parameters())), None)


def match_saved(
    sources: CheckpointSources, entries: list[Entry], records: dict[str, Any]
) -> list[Entry]:
    """``entries`` with each model and optimizer read the way the checkpoint holds it: the
    shards of a sharded save into any live model (sharded or not: DCP reshards), a full
    state file into a sharded model (gathered on rank 0, broadcast: a plain run's save).

    Raises:
        CheckpointError: the checkpoint holds shards of a state this run did not prepare.
    """
    saved = {p for n in records if (p := layout.sharded_prefix_of(n)) is not None}
    modules = sources.modules()
    out: list[Entry] = []
    for entry in entries:
        target = entry.target
        if isinstance(target, dcp.ShardedState) and target.prefix not in saved:
            full = f"{target.prefix}.safetensors"
            if full in records:  # a plain (or FULL_STATE_DICT) save into a sharded model
                if isinstance(target, dcp.OptimizerShards):
                    state: Any = ShardedOptimizerState(target.module, target.optimizer)
                else:
                    assert isinstance(target, dcp.ModelShards)
                    state = ShardedModelState(target.module)
                entry = Entry(full, state, "collective", entry.kind)
        elif entry.file.endswith(".safetensors") and entry.file[: -len(".safetensors")] in saved:
            prefix = entry.file[: -len(".safetensors")]
            index = int(prefix.rsplit("_", 1)[1])
            if isinstance(target, ShardedModelState | torch.nn.Module) and prefix.startswith(
                "model"
            ):
                module = target.module if isinstance(target, ShardedModelState) else target
                entry = Entry(prefix, dcp.ModelShards(index, module), "sharded", entry.kind)
            elif isinstance(target, ShardedOptimizerState | torch.optim.Optimizer):
                optimizer = (
                    target.optimizer if isinstance(target, ShardedOptimizerState) else target
                )
                owner = (
                    target.module
                    if isinstance(target, ShardedOptimizerState)
                    else _owner(optimizer, modules)
                )
                if owner is not None:
                    shards = dcp.OptimizerShards(index, owner, optimizer)
                    entry = Entry(prefix, shards, "sharded", entry.kind)
        out.append(entry)
    planned = {e.target.prefix for e in out if isinstance(e.target, dcp.ShardedState)}
    for prefix in sorted(saved - planned):
        raise CheckpointError(
            f"the checkpoint holds the shards of {prefix}: this run prepared no object for "
            "them (prepare the same models and optimizers as the run that saved it)"
        )
    return out

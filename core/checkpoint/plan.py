"""What a checkpoint holds: one entry per file, each an object with torch's ``Stateful``
protocol. To add something to checkpoints, add its entry in :func:`entries` (and, if it is
not ``Stateful`` already, an adapter in :mod:`kwplug.checkpoint.stateful`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import attrs

from kwplug.checkpoint import layout, sharded
from kwplug.checkpoint.stateful import (
    RankState,
    ShardedModelState,
    ShardedOptimizerState,
    Stateful,
)

if TYPE_CHECKING:
    from kwplug.accelerator import Accelerator

#: ``main``: rank 0 saves and loads it; ``collective``: every rank takes part, rank 0 writes
#: the file and reads it (the others get ``{}``); ``each``: every rank its own file.
Scope = Literal["main", "collective", "each"]


@attrs.frozen
class Entry:
    """One file of a checkpoint and the object saved into it."""

    file: str
    target: Stateful
    scope: Scope
    optional: bool = False  # loaded only when the file exists (the scaler: fp16 only)


def entries(accelerator: Accelerator) -> list[Entry]:
    """The files of ``accelerator``'s checkpoint on this rank, in save and load order.

    Raises:
        NotImplementedError: an optimizer steps a sharded model's parameters together with
            parameters outside that model.
    """
    acc = accelerator
    modules = [acc.unwrap_model(m) for m in acc._models]
    owners = sharded.optimizer_owners(modules, acc._optimizers)
    plan: list[Entry] = []
    for i, module in enumerate(modules):
        if sharded.is_sharded(module):
            plan.append(Entry(layout.model_file(i), ShardedModelState(module), "collective"))
        else:
            plan.append(Entry(layout.model_file(i), module, "main"))
    for i, optimizer in enumerate(acc._optimizers):
        if i in owners:
            state = ShardedOptimizerState(owners[i], optimizer)
            plan.append(Entry(layout.optimizer_file(i), state, "collective"))
        else:
            plan.append(Entry(layout.optimizer_file(i), optimizer, "main"))
    if acc.scaler is not None:
        plan.append(Entry(layout.SCALER, acc.scaler, "main", optional=True))
    for i, obj in enumerate(acc._custom_objects):
        plan.append(Entry(layout.custom_file(i), obj, "main"))
    rank = RankState(
        world_size=acc.num_processes,
        device=acc.device,
        loaders=acc._dataloaders,
        models=acc._models,
        collect_handlers=lambda: collect_handler_state(acc),
        restore_handlers=lambda saved: restore_handler_state(acc, saved),
    )
    plan.append(Entry(layout.rank_file(acc.process_index), rank, "each"))
    return plan


def collect_handler_state(accelerator: Accelerator) -> dict[str, Any]:
    """Every plugin's ``handler_state`` answer, by registered plugin name."""
    # By name, so that each plugin gets its own state back.
    answers = accelerator._call_each("handler_state")
    return {name: state for name, state in answers if state is not None}


def restore_handler_state(accelerator: Accelerator, saved: Mapping[str, Any]) -> None:
    """Give each plugin its saved state back (``load_handler_state``)."""
    for name, state in saved.items():
        accelerator._call_each("load_handler_state", only=name.__eq__, state=state)

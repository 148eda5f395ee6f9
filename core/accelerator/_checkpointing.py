"""Checkpointing: ``save_state``, ``load_state`` and ``register_for_checkpointing``.

MERGE NOTE: the bodies below are ``Accelerator``'s former methods, moved verbatim (each takes
the Accelerator as ``self``; the public docstrings stay on the facade). A rewrite of
checkpointing replaces this module; the Accelerator's facade delegates here and keeps every
attribute these bodies read (``_models``, ``_optimizers``, ``_scaled_optimizers``,
``_dataloaders``, ``_custom_objects``, ``scaler``, ``device``, ``process_index``,
``num_processes``, ``is_main_process``, ``unwrap_model``, ``wait_for_everyone``,
``_call_each``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from kwplug import checkpoint, sharded
from kwplug.data import PreparedDataLoader

if TYPE_CHECKING:
    from kwplug.accelerator._facade import Accelerator


def register_for_checkpointing(self: Accelerator, *objects: Any) -> None:
    for obj in objects:
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"{type(obj).__qualname__} cannot be checkpointed: it needs state_dict() "
                "and load_state_dict()"
            )
        self._custom_objects.append(obj)


def save_state(self: Accelerator, output_dir: str | os.PathLike[str]) -> Path:
    if not os.fspath(output_dir):
        raise ValueError("save_state needs a checkpoint directory, got an empty path")
    directory = Path(output_dir).absolute()
    if self.is_main_process:
        checkpoint.prepare_staging(directory)
    self.wait_for_everyone()
    staging = checkpoint.staging_dir(directory)
    # Sharded (FSDP2) models and their optimizers are gathered by collectives: every rank.
    modules = [self.unwrap_model(m) for m in self._models]
    full_models, full_optimizers = sharded.gather_full_states(modules, self._optimizers)
    if self.is_main_process:
        for i, module in enumerate(modules):
            state = full_models[i] if i in full_models else module.state_dict()
            checkpoint.atomic_save(state, staging / f"model_{i}.pt")
        for i, optimizer in enumerate(self._optimizers):
            state = full_optimizers[i] if i in full_optimizers else optimizer.state_dict()
            checkpoint.atomic_save(state, staging / f"optimizer_{i}.pt")
        if self.scaler is not None:
            checkpoint.atomic_save(self.scaler.state_dict(), staging / "scaler.pt")
        for i, obj in enumerate(self._custom_objects):
            checkpoint.atomic_save(obj.state_dict(), staging / f"custom_{i}.pt")
    per_rank = {
        "world_size": self.num_processes,
        "handlers": self._collect_handler_state(),
        "rng": checkpoint.rng_state(self.device),
        "dataloaders": [_loader_state(dl) for dl in self._dataloaders],
        "comm_hooks": [
            [checkpoint.hook_state_dict(state) for _, state in _comm_hook_states(model)]
            for model in self._models
        ],
    }
    checkpoint.atomic_save(per_rank, staging / f"rank_{self.process_index}.pt")
    self.wait_for_everyone()
    if self.is_main_process:
        checkpoint.commit(directory)
    self.wait_for_everyone()
    return directory


def load_state(self: Accelerator, input_dir: str | os.PathLike[str]) -> Path:
    if not os.fspath(input_dir):
        raise ValueError("load_state needs a checkpoint directory, got an empty path")
    directory = checkpoint.resolve_checkpoint(input_dir)
    if directory is None:
        raise FileNotFoundError(
            f"no complete kwplug checkpoint at {os.fspath(input_dir)!r} (a directory "
            f"with a {checkpoint.MARKER} marker)"
        )
    rank_file = directory / f"rank_{self.process_index}.pt"
    if not rank_file.is_file():
        raise ValueError(f"{directory} has no state for rank {self.process_index}")
    per_rank = torch.load(rank_file, map_location="cpu", weights_only=False)
    if per_rank["world_size"] != self.num_processes:
        raise ValueError(
            f"{directory} was saved by {per_rank['world_size']} processes, this run has "
            f"{self.num_processes}"
        )
    modules = [self.unwrap_model(m) for m in self._models]
    owners = sharded.optimizer_owners(modules, self._optimizers)
    main = self.is_main_process
    for i, module in enumerate(modules):
        if sharded.is_sharded(module):  # a collective: rank 0 reads, all ranks load
            sharded.load_full_model(module, directory / f"model_{i}.pt", is_main_process=main)
            continue
        state = torch.load(directory / f"model_{i}.pt", map_location=self.device)
        module.load_state_dict(state)
    for i, optimizer in enumerate(self._optimizers):
        if i in owners:
            path = directory / f"optimizer_{i}.pt"
            sharded.load_full_optimizer(owners[i], optimizer, path, is_main_process=main)
            continue
        state = torch.load(directory / f"optimizer_{i}.pt", map_location=self.device)
        optimizer.load_state_dict(state)
    if self.scaler is not None and (directory / "scaler.pt").is_file():
        self.scaler.load_state_dict(torch.load(directory / "scaler.pt"))
    for i, obj in enumerate(self._custom_objects):
        obj.load_state_dict(torch.load(directory / f"custom_{i}.pt", weights_only=False))
    saved_loaders = per_rank["dataloaders"]
    if len(saved_loaders) != len(self._dataloaders):
        raise ValueError(
            f"{directory} holds {len(saved_loaders)} data loader position(s), "
            f"{len(self._dataloaders)} data loader(s) are prepared"
        )
    for loader, position in zip(self._dataloaders, saved_loaders, strict=True):
        if position is not None and isinstance(loader, PreparedDataLoader):
            loader.load_state_dict(position)
    for model, saved in zip(self._models, per_rank["comm_hooks"], strict=False):
        for (_, state), snapshot in zip(_comm_hook_states(model), saved, strict=False):
            checkpoint.load_hook_state(state, snapshot)
    self._restore_handler_state(per_rank.get("handlers", {}))
    checkpoint.set_rng_state(per_rank["rng"], self.device)
    self.wait_for_everyone()
    return directory


def _collect_handler_state(self: Accelerator) -> dict[str, Any]:
    # By registered plugin name, so that each plugin gets its own state back.
    # By registered plugin name, so that each plugin gets its own state back.
    answers = self._call_each("handler_state")
    return {name: state for name, state in answers if state is not None}


def _restore_handler_state(self: Accelerator, saved: Mapping[str, Any]) -> None:
    for name, state in saved.items():
        self._call_each("load_handler_state", only=name.__eq__, state=state)


def _loader_state(loader: DataLoader[Any]) -> dict[str, int] | None:
    return loader.state_dict() if isinstance(loader, PreparedDataLoader) else None


def _comm_hook_states(model: torch.nn.Module) -> list[tuple[Any, Any]]:
    # DDP keeps (hook, state) pairs of register_comm_hook in `_comm_hooks`.
    hooks: list[tuple[Any, Any]] = getattr(model, "_comm_hooks", None) or []
    return list(hooks)

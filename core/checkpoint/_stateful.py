"""Adapters that make what an ``Accelerator`` prepared checkpointable through torch's
``Stateful`` protocol (``torch.distributed.checkpoint.stateful.Stateful``: ``state_dict()``
and ``load_state_dict(state)``). The registry through which wrapper plugins hand their
per-rank state (e.g. a DDP communication hook's) lives below the plugins, in
:mod:`kwplug.attached_state`; :class:`RankState` saves it.

Adding something to checkpoints means one adapter here and one entry in
:func:`kwplug.checkpoint._plan.entries`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from kwplug.attached_state import attached_states, hook_state_dict, load_hook_state
from kwplug.checkpoint import _layout as layout
from kwplug.checkpoint import _position
from kwplug.checkpoint import _resize as resize
from kwplug.checkpoint import _rng as rng
from kwplug.checkpoint import _sharded as sharded
from kwplug.data import PreparedDataLoader
from kwplug.errors import CheckpointError, KwplugWarning


class Stateful(Protocol):
    """torch's ``Stateful`` protocol, restated for type checking."""

    def state_dict(self) -> dict[str, Any]:
        """What to save."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...


class ShardedModelState:
    """A model with ``DTensor`` parameters as its full state dict (collectives: every rank)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        """The full state dict on rank 0, ``{}`` elsewhere (gathered by every rank)."""
        return sharded.full_model_state(self.module)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the full ``state_dict`` given on rank 0 (``{}`` elsewhere) into the shards."""
        sharded.load_full_model(self.module, state_dict)


class ShardedOptimizerState:
    """The optimizer of a sharded model as torch's full optimizer state dict (collectives)."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state dict on rank 0, ``{}`` elsewhere."""
        return sharded.full_optimizer_state(self.module, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the full optimizer state dict given on rank 0 (``{}`` elsewhere)."""
        sharded.load_full_optimizer(self.module, self.optimizer, state_dict)


def _missing_warning(path: Path | None, rank: int, saver: int) -> None:
    where = path.parent if path is not None else "the checkpoint"
    warnings.warn(
        f"load_state on process {rank}: {where} holds no {layout.rank_file(rank)} (it was "
        f"saved by process {saver} alone, e.g. under `if accelerator.is_main_process:`): "
        f"this process takes the data loader positions from {layout.rank_file(saver)} (they "
        "are the same on every process) and keeps its own RNG states, communication-hook "
        "state and plugins' handler state (not saved); save on every process for an exact "
        "resume",
        KwplugWarning,
        stacklevel=2,
    )


class RankState:
    """What each process saves of its own: RNG states, data loader positions, the states
    attached to the models (communication hooks) and the plugins' ``handler_state``."""

    def __init__(
        self,
        *,
        world_size: int,
        device: torch.device,
        loaders: Sequence[DataLoader[Any]],
        process_index: int = 0,
        exact_positions: bool = False,
        models: Sequence[torch.nn.Module],
        collect_handlers: Callable[[], dict[str, Any]],
        restore_handlers: Callable[[Mapping[str, Any]], None],
    ) -> None:
        self.world_size, self.device = world_size, device
        self.loaders, self.models = loaders, models
        self.collect_handlers, self.restore_handlers = collect_handlers, restore_handlers
        self.process_index, self.exact_positions = process_index, exact_positions
        self._resized: list[Any] = []  # positions moved to this size by check()
        self._path: Path | None = None  # the file check() was given

    def state_dict(self) -> dict[str, Any]:
        """The per-rank state (see the class docstring)."""
        return {
            "world_size": self.world_size,
            "rank": self.process_index,
            "handlers": self.collect_handlers(),
            "rng": rng.rng_state(self.device),
            "dataloaders": [
                dl.state_dict() if isinstance(dl, PreparedDataLoader) else None
                for dl in self.loaders
            ],
            "comm_hooks": [
                [hook_state_dict(state) for state in attached_states(model)]
                for model in self.models
            ],
            "sharding": [resize.describe(dl) for dl in self.loaders],
        }

    def check(self, state_dict: Any, path: Path) -> None:
        """Refuse a ``state_dict`` (read from ``path``) that does not fit this run.

        Raises:
            CheckpointError: saved for another number of data loaders, by another number of
                processes with a data position that cannot be moved to this one
                (:func:`kwplug.checkpoint._resize.convert_position`), or not a per-rank state.
        """
        keys = ("world_size", "rng", "dataloaders", "comm_hooks")
        if not isinstance(state_dict, dict) or any(k not in state_dict for k in keys):
            raise CheckpointError(f"{path} does not hold a kwplug per-rank state", path)
        self._path = path
        saved = state_dict["dataloaders"]
        if len(saved) != len(self.loaders):
            raise CheckpointError(
                f"{path} holds {len(saved)} data loader position(s), "
                f"{len(self.loaders)} data loader(s) are prepared",
                path,
            )
        old = int(state_dict["world_size"])
        if old != self.world_size:  # resized: move every position now, so nothing is loaded
            sharding = state_dict.get("sharding") or [None] * len(saved)
            self._resized = [
                resize.convert_position(position, shape, loader, old, path)
                if position is not None and isinstance(loader, PreparedDataLoader)
                else position
                for position, shape, loader in zip(saved, sharding, self.loaders, strict=True)
            ]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore everything :meth:`state_dict` saved (RNG states last); a state saved by
        another number of processes (the saved rank 0's) as :mod:`._resize` describes."""
        old = int(state_dict["world_size"])
        positions = state_dict["dataloaders"] if old == self.world_size else self._resized
        saver = state_dict.get("rank", self.process_index)
        foreign = old == self.world_size and saver != self.process_index
        for index, (loader, position) in enumerate(zip(self.loaders, positions, strict=True)):
            if position is None or not isinstance(loader, PreparedDataLoader):
                continue
            if foreign:  # another rank's torchdata iterator state is not this rank's
                position = _position.shared_part(position)
            if not (self.exact_positions or _position.is_stateful(loader)):
                position = _position.at_epoch_start(index, position)  # as Accelerate's
            loader.load_state_dict(position)
        if foreign:
            self._keep_own(int(saver))  # saved by the main process alone
            return
        if old == self.world_size:
            for model, saved in zip(self.models, state_dict["comm_hooks"], strict=False):
                for state, snapshot in zip(attached_states(model), saved, strict=False):
                    load_hook_state(state, snapshot)
        else:
            live = [attached_states(model) for model in self.models]
            resize.load_resized_hooks(live, state_dict["comm_hooks"], (old, self.world_size))
        self.restore_handlers(state_dict.get("handlers", {}))
        if old == self.world_size:
            rng.set_rng_state(state_dict["rng"], self.device)
        else:
            resize.set_resized_rng(state_dict["rng"], resize.rank(), self.device)

    def _keep_own(self, saver: int) -> None:
        # Another rank's file at this world size: only the main process saved (data positions
        # are the run's, the rest is this process's own and was not saved).
        _missing_warning(self._path, self.process_index, saver)

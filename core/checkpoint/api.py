"""``save_state`` / ``load_state`` / ``register_for_checkpointing`` of an ``Accelerator``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kwplug.checkpoint import commit, layout, plan

if TYPE_CHECKING:
    from kwplug.accelerator import Accelerator


def register_for_checkpointing(accelerator: Accelerator, *objects: Any) -> None:
    """See ``Accelerator.register_for_checkpointing``."""
    for obj in objects:
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"{type(obj).__qualname__} cannot be checkpointed: it needs state_dict() "
                "and load_state_dict()"
            )
        accelerator._custom_objects.append(obj)


def save_state(accelerator: Accelerator, output_dir: str | os.PathLike[str]) -> Path:
    """See ``Accelerator.save_state``."""
    acc = accelerator
    if not os.fspath(output_dir):
        raise ValueError("save_state needs a checkpoint directory, got an empty path")
    directory = Path(output_dir).absolute()
    main = acc.is_main_process
    if main:
        commit.prepare_staging(directory)
    acc.wait_for_everyone()
    staging = layout.staging_dir(directory)
    for entry in plan.entries(acc):
        if entry.scope == "main" and not main:
            continue
        state = entry.target.state_dict()  # collective entries: on every rank
        if main or entry.scope == "each":
            commit.atomic_save(state, staging / entry.file)
    acc.wait_for_everyone()
    if main:
        commit.commit(directory)
    acc.wait_for_everyone()
    return directory


def load_state(accelerator: Accelerator, input_dir: str | os.PathLike[str]) -> Path:
    """See ``Accelerator.load_state``."""
    acc = accelerator
    if not os.fspath(input_dir):
        raise ValueError("load_state needs a checkpoint directory, got an empty path")
    directory = commit.resolve_checkpoint(input_dir)
    if directory is None:
        raise FileNotFoundError(
            f"no complete kwplug checkpoint at {os.fspath(input_dir)!r} (a directory "
            f"with a {layout.MARKER} marker)"
        )
    entries = plan.entries(acc)
    rank_entry = entries[-1]
    rank_file = directory / rank_entry.file
    if not rank_file.is_file():
        raise ValueError(f"{directory} has no state for rank {acc.process_index}")
    per_rank = torch.load(rank_file, map_location="cpu", weights_only=False)
    rank_entry.target.check(per_rank, str(directory))  # type: ignore[attr-defined]
    main = acc.is_main_process
    for entry in entries[:-1]:
        path = directory / entry.file
        if entry.optional and not path.is_file():
            continue
        if entry.scope == "collective":
            state = torch.load(path, map_location="cpu", weights_only=False) if main else {}
        else:
            state = torch.load(path, map_location=acc.device, weights_only=False)
        entry.target.load_state_dict(state)
    rank_entry.target.load_state_dict(per_rank)
    acc.wait_for_everyone()
    return directory

"""Resuming a checkpoint on another number of processes (replicated state, or FSDP2's full
state dicts).

What changes with the number of processes, and the rule for each (docs/reliability.md):

- **Per-rank files.** Every rank reads the saved rank 0's ``rank_0`` file (:func:`rank_entries`).
- **Data position**, in batches of the user's batch sampler (``U``, the same at every size):
  ``U = offset + batches_yielded * W_old`` when batches are dealt whole, ``batches_yielded``
  with ``split_batches``. At ``W_new`` processes each rank skips ``U // W_new`` of its own
  batches after ``U % W_new`` batches are skipped before dealing (the loader's ``offset``), so
  the global stream continues at exactly the next unconsumed batch (:func:`convert_position`).
- **RNG states.** Rank 0 restores the saved rank 0's; rank ``r > 0`` is seeded from
  ``sha256(saved rank 0's torch CPU state, r)`` (:func:`set_resized_rng`).
- **Communication-hook state.** An attached state that has a rule of its own
  (``resize_state_dict(saved, old_world_size, new_world_size)``; a :class:`kwplug.CommHook`'s
  ``resize``) loads what the rule makes of the saved rank 0's; the others start afresh. One
  warning names every state reset and every rule that does not keep everything (its
  ``resize_note``) (:func:`load_resized_hooks`).
- **Optimizer files** of an FSDP2 run (keyed by parameter name) load into a plain optimizer
  and the other way round (:func:`adapt_optimizer_state`).
"""

from __future__ import annotations

import hashlib
import random
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from kwplug.attached_state import load_hook_state, state_label
from kwplug.checkpoint import _layout as layout
from kwplug.checkpoint import _rng as rng
from kwplug.data import DispatchedDataLoader, PreparedDataLoader
from kwplug.errors import CheckpointError, KwplugWarning


def saved_world_size(records: Mapping[str, Any]) -> int:
    """Number of processes that saved a checkpoint: its ``rank_<r>`` files."""
    return sum(1 for name in records if _is_rank_state(name))


def _is_rank_state(name: str) -> bool:
    # rank_<r>, not accumulation_<r> (written only mid-accumulation, refused across sizes).
    return name.startswith("rank_") and layout.is_rank_file(name)


def rank_entries(
    entries: Sequence[Any],
    records: Mapping[str, Any],
    world_size: int,
    main_only: int | None = None,
) -> list[Any]:
    """``entries`` with this rank's per-rank file replaced by ``rank_0`` when the checkpoint
    (manifest ``records``) was saved by another number of processes than ``world_size``, or
    by the main process alone (``main_only``: the number of processes of that run; then a
    rank of a run of that size loads the data positions of ``rank_0`` and keeps its own RNG
    states, see :class:`kwplug.checkpoint._stateful.RankState`)."""
    if main_only is None and saved_world_size(records) in (0, world_size):
        return list(entries)
    first = layout.rank_file(0)
    return [
        attrs.evolve(e, file=first) if e.scope == "each" and _is_rank_state(e.file) else e
        for e in entries
    ]


def describe(loader: DataLoader[Any]) -> dict[str, Any] | None:
    """What the position of ``loader`` needs to be moved to another size (saved with it)."""
    if not isinstance(loader, PreparedDataLoader):
        return None
    user = _user_sharded(loader)
    return {
        "split_batches": loader.sharding.split_batches,
        "batch_size": _user_batch_size(loader),
        "iterable": isinstance(loader.dataset, IterableDataset),
        "user_sharded": user,
    }


def _user_batch_size(loader: PreparedDataLoader) -> int | None:
    size, n = loader.batch_size, loader.sharding.num_processes
    if isinstance(loader, DispatchedDataLoader) and isinstance(loader.dataset, IterableDataset):
        return size  # a dispatched stream keeps the user's batch size (as Accelerate)
    return size * n if (size is not None and loader.sharding.split_batches and n > 1) else size


def _user_sharded(loader: PreparedDataLoader) -> bool:
    holder = getattr(loader.batch_sampler, "batches", None)
    inner = getattr(holder, "batch_sampler", holder)
    return isinstance(getattr(inner, "sampler", None), DistributedSampler)


#: The keys of a position of a loader prepared without ``use_stateful_dataloader``.
_POSITION_KEYS = frozenset(("epoch", "batches_yielded", "generator", "global_rng", "offset"))


def convert_position(
    position: dict[str, Any],
    saved: Mapping[str, Any] | None,
    loader: PreparedDataLoader,
    old_size: int,
    path: Path,
) -> dict[str, Any]:
    """``position`` (saved by rank 0 of ``old_size`` processes) at this run's size.

    Raises:
        CheckpointError: the loader's batch size or ``split_batches`` changed, it is sharded
            by a user's ``DistributedSampler``, or an iterable data set's position falls
            inside one of the new processes' batches.
    """
    new_size = loader.sharding.num_processes
    here = describe(loader)
    assert here is not None
    if saved is None:
        raise CheckpointError(f"{path} holds no data loader sharding: cannot resize it", path)
    for key in ("split_batches", "batch_size", "iterable"):
        if saved.get(key) != here[key]:
            raise CheckpointError(
                f"{path}: a data loader's {key} was {saved.get(key)!r} when saved and is "
                f"{here[key]!r} now; its position cannot be moved from {old_size} to "
                f"{new_size} processes",
                path,
            )
    if saved.get("user_sharded") or here["user_sharded"]:
        raise CheckpointError(
            f"{path}: a data loader shards with a user's DistributedSampler; its position "
            f"cannot be moved from {old_size} to {new_size} processes (let prepare shard it)",
            path,
        )
    if any(key not in _POSITION_KEYS for key in position):
        raise CheckpointError(
            f"{path}: a data loader prepared with use_stateful_dataloader=True holds "
            "torchdata's state of its iterator (per process, for that number of processes); "
            f"its position cannot be moved from {old_size} to {new_size} processes (resume "
            f"on {old_size}, or prepare the loader without the flag)",
            path,
        )
    yielded, offset = int(position["batches_yielded"]), int(position.get("offset") or 0)
    if here["split_batches"]:  # every rank took a slice of the same global batches
        return {**position, "batches_yielded": yielded, "offset": 0}
    consumed = offset + yielded * old_size  # batches of the user's batch sampler
    batches, offset = divmod(consumed, new_size)
    if offset and here["iterable"]:
        raise CheckpointError(
            f"{path}: an iterable data set's position ({consumed} batches dealt to {old_size} "
            f"processes) is not a whole number of rounds of {new_size} processes",
            path,
        )
    return {**position, "batches_yielded": batches, "offset": offset}


def set_resized_rng(saved: dict[str, Any], rank: int, device: torch.device) -> None:
    """Rank 0: the saved rank 0's RNG states; rank ``r``: seeded from them and ``r``."""
    if rank == 0:
        rng.set_rng_state(saved, device)
        return
    digest = hashlib.sha256(saved["torch"].numpy().tobytes() + rank.to_bytes(8, "little"))
    seed = int.from_bytes(digest.digest()[:8], "little") >> 1
    random.seed(seed)
    torch.manual_seed(seed)  # also every accelerator device
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is optional
        pass


def load_resized_hooks(
    live: Sequence[Sequence[Any]], saved: Sequence[Sequence[Any]], sizes: tuple[int, int]
) -> None:
    """Move the saved rank 0's communication-hook states (per model) into the ``live`` ones
    of a run with another number of processes.

    A live state with ``resize_state_dict(saved, old_world_size, new_world_size)`` loads its
    answer (``None``: it starts afresh); any other starts afresh. One warning (main process
    only) names each state that starts afresh and each one whose rule has a ``resize_note``
    (what the rule does not carry over).

    Args:
        live: per model, the states attached to it in this run.
        saved: per model, the saved rank 0's snapshots (``None`` for a stateless hook).
        sizes: ``(old_world_size, new_world_size)``.
    """
    old, new = sizes
    named: list[str] = []
    for index, snapshots in enumerate(saved):
        states = list(live[index]) if index < len(live) else []
        for position, snapshot in enumerate(snapshots):
            if snapshot is None:
                continue
            state = states[position] if position < len(states) else None
            if state is None:
                named.append(f"model {index}: {_saved_name(snapshot)} (no hook in this run)")
                continue
            label = state_label(state)
            rule = getattr(state, "resize_state_dict", None)
            value = rule(snapshot["value"], old, new) if callable(rule) else None
            if value is None:
                named.append(f"model {index}: {label} (reset)")
                continue
            load_hook_state(state, {**snapshot, "value": value})
            note = getattr(state, "resize_note", "")
            if isinstance(note, str) and note:
                named.append(f"model {index}: {label} ({note})")
    if named and rank() == 0:
        warnings.warn(
            f"kwplug checkpoint saved by {old} process(es), loaded by {new}: communication "
            f"hook state that belongs to one process (error feedback, residuals, low-rank "
            f"factors) is moved by its hook's resize rule or starts afresh: "
            f"{'; '.join(named)}",
            KwplugWarning,
            stacklevel=2,
        )


def _saved_name(snapshot: Mapping[str, Any]) -> str:
    label = snapshot.get("label")
    return label if isinstance(label, str) and label else "a communication hook's state"


def adapt_optimizer_state(
    state: dict[str, Any], optimizer: torch.optim.Optimizer, module: torch.nn.Module | None
) -> dict[str, Any]:
    """``state`` keyed as ``optimizer.load_state_dict`` (plain: by parameter index) expects,
    when it was saved keyed by parameter name (an FSDP2 run's full optimizer state).

    Returns ``state`` unchanged when it is keyed by index already, or when no ``module``
    owns the optimizer's parameters.
    """
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if (
        module is None
        or not groups
        or not all(isinstance(p, str) for g in groups for p in g.get("params", ()))
    ):
        return state
    names = {id(p): name for name, p in module.named_parameters()}
    live = [p for g in optimizer.param_groups for p in g["params"]]
    index = {names.get(id(p), f"<unnamed {i}>"): i for i, p in enumerate(live)}
    try:
        new_groups = [{**g, "params": [index[p] for p in g["params"]]} for g in groups]
        new_state = {index[k]: v for k, v in state.get("state", {}).items()}
    except KeyError as exc:
        raise CheckpointError(f"the optimizer state names parameter {exc}, unknown here") from exc
    return {"state": new_state, "param_groups": new_groups}


def to_named_optimizer_state(
    state: dict[str, Any], optimizer: torch.optim.Optimizer, module: torch.nn.Module
) -> dict[str, Any]:
    """The reverse of :func:`adapt_optimizer_state`: a plain run's optimizer state keyed by
    parameter name, as torch's full optimizer state dict of sharded ``module``."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not groups or not all(isinstance(p, int) for g in groups for p in g.get("params", ())):
        return state
    names = {id(p): name for name, p in module.named_parameters()}
    live = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return {
        "state": {live[int(k)]: v for k, v in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [live[p] for p in g["params"]]} for g in groups],
    }


def rank() -> int:
    """This process's rank in the default group (0 without one)."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

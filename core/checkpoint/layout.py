"""Every name a kwplug checkpoint directory holds: the one place that says what goes where.

Layout of a checkpoint directory ``DIR``::

    model_<i>.pt          unwrapped model state dicts (rank 0)
    optimizer_<i>.pt      optimizer state dicts (rank 0)
    scaler.pt             GradScaler state (rank 0, fp16 only)
    custom_<i>.pt         objects given to ``register_for_checkpointing`` (rank 0)
    rank_<r>.pt           per rank: RNG states (Python, NumPy, torch CPU and device), data
                          loader positions, stateful DDP communication hook states
    COMPLETE              written last: a directory without it is not a checkpoint
"""

from __future__ import annotations

from pathlib import Path

MARKER = "COMPLETE"
PARTIAL_SUFFIX = ".partial"
PREVIOUS_SUFFIX = ".previous"
SCALER = "scaler.pt"


def model_file(index: int) -> str:
    """File of the ``index``-th prepared model."""
    return f"model_{index}.pt"


def optimizer_file(index: int) -> str:
    """File of the ``index``-th prepared optimizer."""
    return f"optimizer_{index}.pt"


def custom_file(index: int) -> str:
    """File of the ``index``-th object given to ``register_for_checkpointing``."""
    return f"custom_{index}.pt"


def rank_file(rank: int) -> str:
    """File of the per-rank state of process ``rank``."""
    return f"rank_{rank}.pt"


def staging_dir(directory: Path) -> Path:
    """Where a save into ``directory`` is built before it is swapped in."""
    return directory.with_name(directory.name + PARTIAL_SUFFIX)


def previous_dir(directory: Path) -> Path:
    """Where the replaced checkpoint waits while a new one is swapped in."""
    return directory.with_name(directory.name + PREVIOUS_SUFFIX)

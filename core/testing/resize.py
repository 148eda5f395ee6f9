"""What a resume on another number of processes does to a communication hook's state, in one
process: the check of a :class:`kwplug.CommHook`'s ``resize`` rule."""

from __future__ import annotations

from typing import Any

from kwplug.attached_state import hook_state_dict
from kwplug.checkpoint import load_resized_hooks
from kwplug.validators import is_int


def resize_hook_state(live: Any, saved: Any, *, old_world_size: int, new_world_size: int) -> None:
    """Load into ``live`` what ``Accelerator.load_state`` gives it when a checkpoint holding
    ``saved`` was written by ``old_world_size`` processes and is loaded by ``new_world_size``.

    This is the very step ``load_state`` runs on each rank of a resized resume (rank 0's saved
    state is what every rank reads): the live state's ``resize_state_dict(saved,
    old_world_size, new_world_size)`` -- the record's ``resize`` rule, for states built by
    :func:`kwplug.plugins.ddp_comm_hooks.checkpointed_state` -- loads its answer, and ``None``
    or no rule leaves ``live`` as it is (it starts afresh). One :class:`kwplug.errors.KwplugWarning`
    names the state when it starts afresh or when the rule has a ``resize_note``, as in a
    real resume. A plugin author tests a ``resize`` rule with it, without a checkpoint or
    several processes.

    Args:
        live: the state attached to the model of the resuming run (what
            ``checkpointed_state(record, make_state(...))`` returns).
        saved: the state of the saving run (the same kind of object, holding what that run's
            rank 0 had).
        old_world_size: ``int`` >= 1, the number of processes that saved.
        new_world_size: ``int`` >= 1, the number of processes that load.

    Raises:
        TypeError: a world size that is not an ``int`` (a ``bool`` included).
        ValueError: a world size below 1.
    """
    sizes = {"old_world_size": old_world_size, "new_world_size": new_world_size}
    for name, size in sizes.items():
        if not is_int(size):
            raise TypeError(f"{name} must be an int, got {size!r}")
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")
    load_resized_hooks([[live]], [[hook_state_dict(saved)]], (old_world_size, new_world_size))

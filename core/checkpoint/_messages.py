"""Accelerate's log lines for ``save_state``/``load_state``, through
:mod:`kwplug._process.rank_logging` (the adapter under :mod:`kwplug.logging`: rank 0 only,
``[RANK 0] `` prefix).

Accelerate's ``accelerate.accelerator`` and ``accelerate.checkpointing`` log, on the main
process (``get_logger``'s ``main_process_only``), at these levels and in these words; kwplug
logs the same lines, on logger ``kwplug.checkpoint``, where it does the same thing:

- ``save_state``: INFO ``Saving current state to <output_dir>``; with ``total_limit``, WARNING
  ``Deleting <n> checkpoints to make room for new checkpoint.`` (kwplug deletes after the new
  checkpoint is committed, so the line comes after the save's, and counts only the folders
  it deletes);
- ``load_state``: INFO ``Loading states from <input_dir>``, then ``All model weights loaded
  successfully``, ``All optimizer states loaded successfully``, ``All scheduler states loaded
  successfully``, ``All dataloader sampler states loaded successfully``, ``GradScaler state
  loaded successfully`` (with a loss scaler), ``All random states loaded successfully`` (or
  ``Could not load random states``) and ``Loading in <n> custom states`` (the registered
  objects other than prepared schedulers), each followed, for a folder Accelerate wrote, by
  ``Loading the state of <name> from <folder>/custom_checkpoint_<i>.pkl``.

Accelerate's lines naming the files it writes (``Model weights saved in .../model.safetensors``
and the like) are not logged by ``save_state``: kwplug writes other files (its version folder,
:mod:`kwplug.checkpoint._layout`), and a line naming a file that does not exist would mislead.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kwplug._process.rank_logging import rank_logger
from kwplug.scheduler import AcceleratedScheduler

if TYPE_CHECKING:
    from kwplug.checkpoint._sources import CheckpointSources

logger = rank_logger("kwplug.checkpoint")


def pretty_name(obj: Any) -> str:
    """Accelerate's ``get_pretty_name``: the qualified name of ``obj`` or of its class."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    if hasattr(obj, "__qualname__"):
        return str(obj.__qualname__)
    if hasattr(obj, "__name__"):
        return str(obj.__name__)
    return str(obj)


def custom_objects(sources: CheckpointSources) -> list[Any]:
    """The registered objects Accelerate keeps as ``_custom_objects``: those given to
    ``register_for_checkpointing``, not the prepared schedulers (its ``_schedulers``)."""
    return [o for o in sources.custom_objects if not isinstance(o, AcceleratedScheduler)]


def schedulers(sources: CheckpointSources) -> list[AcceleratedScheduler]:
    """The prepared schedulers, in preparation order (Accelerate's ``_schedulers``)."""
    return [o for o in sources.custom_objects if isinstance(o, AcceleratedScheduler)]


def saving(output_dir: str | os.PathLike[str]) -> None:
    """``Saving current state to <output_dir>`` (INFO), before a save."""
    logger.info(f"Saving current state to {os.fspath(output_dir)}")


def deleting(count: int) -> None:
    """``Deleting <count> checkpoints to make room for new checkpoint.`` (WARNING)."""
    if count:
        logger.warning(f"Deleting {count} checkpoints to make room for new checkpoint.")


def loading(input_dir: str | os.PathLike[str]) -> None:
    """``Loading states from <input_dir>`` (INFO), before a load."""
    logger.info(f"Loading states from {os.fspath(input_dir)}")


def loaded(
    sources: CheckpointSources, *, random_states: bool = True, custom_files: list[str] | None = None
) -> None:
    """The lines Accelerate logs once a load is done, in its order.

    Args:
        sources: what was loaded into.
        random_states: whether this process's RNG states were restored.
        custom_files: the ``custom_checkpoint_<i>.pkl`` paths read (a folder Accelerate
            wrote), one per registered object; ``None`` for kwplug's own checkpoints.
    """
    logger.info("All model weights loaded successfully")
    logger.info("All optimizer states loaded successfully")
    logger.info("All scheduler states loaded successfully")
    logger.info("All dataloader sampler states loaded successfully")
    if sources.scaler is not None:
        logger.info("GradScaler state loaded successfully")
    if random_states:
        logger.info("All random states loaded successfully")
    else:
        logger.info("Could not load random states")
    objects = custom_objects(sources)
    logger.info(f"Loading in {len(objects)} custom states")
    for obj, path in zip(objects, custom_files or [], strict=False):
        logger.info(f"Loading the state of {pretty_name(obj)} from {path}")

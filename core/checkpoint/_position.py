"""Where a prepared data loader starts after ``load_state``: at batch 0 of the saved epoch, as
Accelerate's, unless the exact mid-epoch position is asked for.

Accelerate's ``load_state`` restores the RNG states (and a ``SeedableRandomSampler``'s epoch)
but not how far the loader got: the resumed loader starts an epoch at its first batch, and
scripts skip what was trained themselves (``accelerator.skip_first_batches(loader, n)``,
diffusers' ``if step < resume_step: continue``, or by starting the next epoch). A loader that
resumed mid-epoch would have them skip twice. So kwplug keeps the saved epoch and what fixes
its order (the sampler's generator at the epoch start: a replay of that epoch's order stays
exact, where Accelerate's draws a new one) and sets the batch count to 0, saying so at INFO
level (``kwplug.checkpoint``'s logger, main process).

The exact mid-epoch position stays available as Accelerate offers it, with
``DataLoaderConfiguration(use_stateful_dataloader=True)`` (torchdata's position, untouched
here), or for any prepared loader with ``load_state(..., exact_data_position=True)``.
"""

from __future__ import annotations

import logging
from typing import Any

from kwplug._process.environment import ProcessInfo

# The standard library's logger, not kwplug.logging's rank-aware adapter: that module is
# Accelerate's ``accelerate.logging``, a layer above the checkpoint package
# (tests/gates/test_layers.py). The message is the adapter's: main process, ``[RANK 0] ``.
logger = logging.getLogger("kwplug.checkpoint")


def is_stateful(loader: Any) -> bool:
    """A loader prepared with ``use_stateful_dataloader=True`` (its position is torchdata's,
    restored mid-epoch as under Accelerate)."""
    return bool(getattr(loader, "use_stateful_dataloader", False))


#: The keys of a position that are the same on every rank (a stateful loader's torchdata
#: state, beside them, is its own rank's).
_SHARED = ("epoch", "batches_yielded", "generator", "global_rng", "offset")


def shared_part(position: dict[str, Any]) -> dict[str, Any]:
    """What of another rank's saved ``position`` this rank can load (a checkpoint saved by
    the main process alone): the epoch, its order and the batch count, not torchdata's
    state of that rank's iterator."""
    return {k: position[k] for k in _SHARED if k in position}


def at_epoch_start(index: int, position: dict[str, Any]) -> dict[str, Any]:
    """``position`` (a prepared loader's ``state_dict()``) moved back to the start of its
    epoch: same epoch and order, ``batches_yielded`` 0 (and no ``offset``: the whole epoch is
    dealt again). Logs at INFO level when that drops batches.

    Args:
        index: the loader's index among the prepared loaders (for the message).
        position: the saved position.
    """
    done = int(position.get("batches_yielded") or 0)
    if not done:
        return position
    epoch = int(position.get("epoch") or 0)
    # The main process says it, once (the ranks read only when the record would be emitted).
    if logger.isEnabledFor(logging.INFO) and ProcessInfo.current().rank == 0:
        _say_restarted(index, done, epoch)
    return {**position, "batches_yielded": 0, "offset": 0}


def _say_restarted(index: int, done: int, epoch: int) -> None:
    logger.info(
        f"[RANK 0] load_state: prepared data loader {index} was saved after {done} batch(es) "
        f"of epoch {epoch}; it starts that epoch at batch 0, as Accelerate's (the same order: the "
        f"saved one). Skip them as under Accelerate (accelerator.skip_first_batches(loader, "
        f"{done}), which draws the epoch's order afresh as Accelerate's does), or resume at "
        "the exact batch with load_state(..., exact_data_position=True) or "
        "DataLoaderConfiguration(use_stateful_dataloader=True)",
        stacklevel=2,  # the record names at_epoch_start, as the rank-aware adapter's did
    )

"""Who takes part in a ``save_state``: every rank (the exact, collective save) or the main
process alone (Accelerate's habit: ``if accelerator.is_main_process: accelerator.save_state()``,
as diffusers' training scripts do).

``save_state`` is not a collective in Accelerate: the calling process writes what it holds.
kwplug's exact save is one (every rank writes its own RNG states, data positions and pending
accumulation), so before anything else each rank announces its ``n``-th save through the
default process group's c10d store (``Store.add``; no collective, so a rank that is not
calling ``save_state`` -- training on, waiting in DDP's all-reduce -- is never needed):

- rank 0 waits up to :func:`arrival_timeout` seconds (``KWPLUG_SAVE_STATE_WAIT``, default
  :data:`DEFAULT_WAIT`) for every rank's announcement of save ``n``. All arrived: the
  collective save (:data:`ALL`). Not all: a save by the main process alone (:data:`MAIN`),
  and the Accelerator remembers it (:class:`SaveArrivals`), so that its later saves are main
  process saves at once, without the wait. The decision is published in the store.
- any other rank reads the decision of its ``n``-th save (waiting for rank 0 up to
  ``KWPLUG_RANK_WAIT`` seconds, default the process group's timeout, then a
  :class:`~kwplug.errors.RankTimeoutError` naming rank 0): :data:`ALL` saves collectively;
  :data:`MAIN` means rank 0 saved without it, and it returns with a ``KwplugWarning`` instead
  of hanging.

What a main process save holds is in docs/reliability.md ("Saving from the main process
only"); the load side is :func:`kwplug.checkpoint._resize.rank_entries`.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Literal

import attrs
import torch

from kwplug._runtime import default_store, wait_for_ranks

#: Seconds rank 0 waits for the other ranks' announcement of a save, by default.
DEFAULT_WAIT = 30.0
#: The environment variable that overrides :data:`DEFAULT_WAIT` (seconds, a float >= 0).
WAIT_VARIABLE = "KWPLUG_SAVE_STATE_WAIT"

Mode = Literal["all", "main", "skipped"]
ALL: Mode = "all"  # every rank saves (collective)
MAIN: Mode = "main"  # rank 0 saves alone
SKIPPED: Mode = "skipped"  # a non-main rank whose save rank 0 made alone: nothing to do

_PREFIX = "kwplug/save_state/"
_POLL = 0.02  # seconds between two reads of the arrival count


@attrs.define
class SaveArrivals:
    """An Accelerator's memory of how its saves went: ``main_only`` once a save was made by
    the main process alone (its later saves do not wait for the others)."""

    main_only: bool = False


# Saves announced per default process group, in this process: every rank counts its own
# calls, so that rank 0's n-th save meets the others' n-th. Keyed by the group object (weakly:
# a destroyed and re-created group starts again at 0, as its store does).
_COUNTS: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()


def arrival_timeout() -> float:
    """Seconds rank 0 waits: ``KWPLUG_SAVE_STATE_WAIT`` if set, else :data:`DEFAULT_WAIT`.

    Raises:
        ValueError: the variable is not a number >= 0.
    """
    raw = os.environ.get(WAIT_VARIABLE)
    if raw is None or not raw.strip():
        return DEFAULT_WAIT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses nan
        raise ValueError(f"{WAIT_VARIABLE} must be a number of seconds >= 0, got {raw!r}")
    return value


def _next_number() -> int:
    group = torch.distributed.group.WORLD
    count = _COUNTS.get(group, 0) + 1 if group is not None else 1
    if group is not None:
        _COUNTS[group] = count
    return count


def decide(arrivals: SaveArrivals, rank: int, world_size: int) -> Mode:
    """How this rank takes part in the save it is starting (see the module docstring).

    Args:
        arrivals: the Accelerator's memory (set to main-only by a main process save).
        rank: this process's global rank.
        world_size: the number of processes.

    Returns:
        :data:`ALL`, :data:`MAIN` (rank 0 saves alone) or :data:`SKIPPED` (another rank,
        whose save rank 0 made alone).
    """
    if world_size <= 1 or not torch.distributed.is_initialized():
        return ALL
    # The default group's store: torch has no public accessor for it (torchelastic and
    # torch.distributed.checkpoint use this one too).
    store = default_store()
    number = _next_number()
    arrived, decision = f"{_PREFIX}{number}/arrived", f"{_PREFIX}{number}/mode"
    if rank != 0:
        store.add(arrived, 1)
        # Bounded (KWPLUG_RANK_WAIT, default the process group's timeout), naming rank 0.
        wait_for_ranks(store, [decision], "save_state", rank, world_size, lambda: [0])
        mode = store.get(decision).decode()
        return ALL if mode == ALL else SKIPPED
    mode = MAIN
    if not arrivals.main_only:
        deadline = time.monotonic() + arrival_timeout()
        count = store.add(arrived, 1)
        while count < world_size and time.monotonic() < deadline:
            time.sleep(_POLL)
            count = store.add(arrived, 0)
        mode = ALL if count >= world_size else MAIN
    store.set(decision, mode)
    if mode == MAIN:
        arrivals.main_only = True
    return mode

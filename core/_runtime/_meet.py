"""Bounded meetings of every rank through the default process group's c10d store: kwplug's
collectives never wait out the group timeout without naming whom they wait for.

A meeting is what :mod:`torch.distributed`'s own store-based barrier does (``Store.add`` of
an arrival counter, the last rank to arrive sets a key the others ``Store.wait`` for), with a
deadline of its own and a name: each rank also sets ``<meeting>/rank/<r>``, so that a rank
that gives up names the ranks whose key is missing. A meeting may carry a digest (the rank
agreement of :mod:`kwplug.accelerator._agreement`): the first rank's digest is put with
``Store.compare_set``, a rank whose digest differs counts itself in ``<meeting>/differs``
before it arrives, so once all have arrived every rank knows whether they agreed, at the cost
of a few store requests per rank (no request grows with the world size). Only when they did
not are the full descriptions exchanged, so that every rank can name the differing fields.

The deadline is :func:`rank_wait` seconds: ``KWPLUG_RANK_WAIT`` when set, else the store's
timeout (the process group's: ``InitProcessGroupKwargs(timeout=...)``, 1800 s by default).
Meetings are counted per channel in each process (every rank's ``n``-th meeting of a channel
meets the others' ``n``-th); a rank deletes its keys of meeting ``n - 2`` when it starts
meeting ``n`` (every rank has left that one by then), so a long run does not grow the store.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from torch._C._distributed_c10d import Store  # torch.distributed.Store, as its stubs name it

from kwplug.errors import RankTimeoutError

#: The environment variable bounding every kwplug wait for other ranks (seconds, > 0).
WAIT_VARIABLE = "KWPLUG_RANK_WAIT"

_PREFIX = "kwplug/meet/"
# Meetings per channel per default process group, in this process; keyed by the group
# object, weakly: a destroyed and re-created group starts at 0 again, as its store does.
_COUNTS: weakref.WeakKeyDictionary[object, dict[str, int]] = weakref.WeakKeyDictionary()


def default_store() -> Store:
    """The default process group's c10d store (torch has no public accessor for it;
    torchelastic and ``torch.distributed.checkpoint`` use this one too)."""
    return dist.distributed_c10d._get_default_store()


def rank_wait(store: Store | None = None) -> float:
    """Seconds a kwplug collective waits for the other ranks: ``KWPLUG_RANK_WAIT`` if set,
    else the store's timeout (the process group's), else 1800.

    Raises:
        ValueError: the variable is not a number of seconds > 0.
    """
    raw = os.environ.get(WAIT_VARIABLE)
    if raw is None or not raw.strip():
        timeout = getattr(store, "timeout", None)
        return timeout.total_seconds() if isinstance(timeout, timedelta) else 1800.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):  # also refuses nan
        raise ValueError(f"{WAIT_VARIABLE} must be a number of seconds > 0, got {raw!r}")
    return value


def _number(channel: str) -> int:
    group = dist.group.WORLD
    counts = _COUNTS.setdefault(group, {}) if group is not None else {}
    counts[channel] = counts.get(channel, 0) + 1
    return counts[channel]


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def wait(store: Store, keys: list[str], what: str, rank: int, world_size: int,
         missing: Callable[[], list[int]]) -> None:  # fmt: skip
    """``store.wait(keys)`` for at most :func:`rank_wait` seconds.

    Args:
        store: the store.
        keys: what to wait for.
        what: what this rank waits at, for the message (``"wait_for_everyone"``).
        rank, world_size: this rank and the number of ranks, for the message.
        missing: after the deadline, the ranks that did not arrive.

    Raises:
        kwplug.errors.RankTimeoutError: the keys did not appear in time (or the store could
            not be reached), naming the missing ranks (torch's error chained).
    """
    seconds = rank_wait(store)
    try:
        store.wait(keys, timedelta(seconds=seconds))
        return
    except RuntimeError as exc:  # DistStoreError: timed out; DistNetworkError: store gone
        error = exc
    try:
        absent = missing()
    except RuntimeError:  # the store itself is gone (its host process exited)
        absent = []
    named = f"{_ranks_text(absent)} did not arrive" if absent else "the store did not answer"
    raise RankTimeoutError(
        f"rank {rank}/{world_size} waited {seconds:g} s at {what} for every rank; {named} "
        f"(every rank must call {what} the same number of times; {WAIT_VARIABLE} sets the "
        f"wait, default the process group's timeout): {str(error).splitlines()[0]}",
        missing=tuple(absent),
        waited_for=what,
        seconds=seconds,
    ) from error


def meet(channel: str, what: str, rank: int, world_size: int, digest: str = "",
         description: Callable[[], str] | None = None) -> list[str] | None:  # fmt: skip
    """Wait until every rank reached its meeting of ``channel`` with this number.

    Args:
        channel: the meetings counted together (``"barrier"``, ``"agree"``).
        what: where this rank is, for messages (``"wait_for_everyone"``, ``"save_state"``).
        rank, world_size: this process's global rank and the number of processes.
        digest: compared across ranks when not empty.
        description: called only when the digests differ: this rank's full description,
            exchanged with every rank.

    Returns:
        ``None`` when every rank brought the same digest (or none); else every rank's
        ``description()``, in rank order.

    Raises:
        kwplug.errors.RankTimeoutError: a rank did not arrive within :func:`rank_wait`
            seconds; the message names it and ``what``.
    """
    store = default_store()
    number = _number(channel)
    base = f"{_PREFIX}{channel}/{number}"
    _forget(store, f"{_PREFIX}{channel}/{number - 2}", rank)
    if digest and store.compare_set(f"{base}/digest", "", digest).decode() != digest:
        store.add(f"{base}/differs", 1)
    store.set(f"{base}/rank/{rank}", what)
    if store.add(f"{base}/arrived", 1) >= world_size:
        store.set(f"{base}/all", "1")

    def absent(prefix: str) -> Callable[[], list[int]]:
        return lambda: [r for r in range(world_size) if not store.check([f"{prefix}{r}"])]

    wait(store, [f"{base}/all"], what, rank, world_size, absent(f"{base}/rank/"))
    if not digest or store.add(f"{base}/differs", 0) == 0:
        return None
    full = [f"{base}/full/{r}" for r in range(world_size)]
    store.set(full[rank], description() if description is not None else digest)
    wait(store, full, what, rank, world_size, absent(f"{base}/full/"))
    return [value.decode() for value in store.multi_get(full)]


def _forget(store: Store, base: str, rank: int) -> None:
    # Housekeeping only: a store that cannot delete (or a key already gone) changes nothing.
    keys = [f"{base}/rank/{rank}", f"{base}/full/{rank}"]
    if rank == 0:
        keys += [f"{base}/digest", f"{base}/differs", f"{base}/arrived", f"{base}/all"]
    for key in keys:
        with contextlib.suppress(RuntimeError, NotImplementedError):
            store.delete_key(key)

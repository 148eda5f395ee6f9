"""How a ``PowerSGDState`` is saved, restored and moved to another number of processes.

The :class:`~kwplug.CommHook` records of ``"power_sgd"`` and ``"batched_power_sgd"`` carry
these rules (``state_dict``, ``load_state_dict``, ``resize``); the checkpoint code only calls
them. A ``PowerSGDState`` is saved as its ``__getstate__`` (every slot but the process group)
plus, under ``"kwplug_bucket_layout"``, the canonical bucket layout of its last step (the
canonical keys of DDP's buckets, in DDP's order; recorded by
:func:`~kwplug.plugins.ddp_comm_hooks.canonical_bucket_hook` from the first step on, whether
or not compression has started): a resumed run's first step cuts DDP's initial bucket along
it, as the saving run's buckets were cut. Across sizes its counters, random generator and
bucket layout are kept and its per-process parts (error feedback, warm-start ``P`` and ``Q``:
one process's residuals and factors, keyed by that process's buckets) start afresh, so
compression goes on without a new warm-up.
"""

import contextlib
from collections.abc import Mapping
from typing import Any

from kwplug.plugins.ddp_comm_hooks._bucket_plan import BUCKET_LAYOUT

#: Saved ``PowerSGDState`` entries kept across sizes (the rest, ``error_dict``,
#: ``p_memory_dict`` and ``q_memory_dict``, is one process's and starts afresh). The bucket
#: layout is the same on every process and does not depend on their number.
POWER_SGD_KEPT = frozenset(
    {
        "iter",
        "rng",
        "total_numel_before_compression",
        "total_numel_after_compression",
        BUCKET_LAYOUT,
    }
)

#: What :func:`resize_power_sgd_state` leaves out, as named in kwplug's resize warning.
POWER_SGD_RESIZE_NOTE = "per-process state reset, counters kept"


def power_sgd_state_dict(state: Any) -> dict[str, Any]:
    """The saved form of a ``PowerSGDState``: its ``__getstate__`` (no process group).

    Args:
        state: a ``PowerSGDState`` (from
            :func:`~kwplug.plugins.ddp_comm_hooks.make_power_sgd_state`).

    Returns:
        Every slot but ``process_group``, by name (tensors, numbers and NumPy's random state),
        and the canonical bucket layout under ``"kwplug_bucket_layout"`` (a tuple of tuples of
        parameter indices) once a step has recorded one.
    """
    saved: dict[str, Any] = state.__getstate__()
    layout = getattr(state, BUCKET_LAYOUT, None)
    if layout is not None:
        saved[BUCKET_LAYOUT] = layout
    return saved


def load_power_sgd_state(state: Any, saved: Mapping[str, Any]) -> None:
    """Restore ``saved`` (all slots, or those :func:`resize_power_sgd_state` kept) into
    ``state``; slots ``saved`` does not name keep their live values, and so does the live
    process group (``PowerSGDState.__setstate__`` would set the default one). The bucket
    layout is ``saved``'s, or none when ``saved`` has none (a checkpoint from before kwplug
    saved it: the resumed run cuts its first buckets by the state's keys, as then); a state
    without the ``kwplug_bucket_layout`` slot ignores it."""
    slots = dict(saved)
    layout = slots.pop(BUCKET_LAYOUT, None)
    process_group = getattr(state, "process_group", None)
    state.__setstate__(slots)
    if process_group is not None:
        state.process_group = process_group
    with contextlib.suppress(AttributeError):  # a plain PowerSGDState has no such slot
        setattr(state, BUCKET_LAYOUT, layout)


def resize_power_sgd_state(
    saved: Mapping[str, Any], old_world_size: int, new_world_size: int
) -> dict[str, Any]:
    """The saved rank 0's PowerSGD state as every rank of a run of ``new_world_size``
    processes loads it: the counters, random generator and bucket layout
    (:data:`POWER_SGD_KEPT`) only.

    Args:
        saved: what :func:`power_sgd_state_dict` returned on the saved rank 0.
        old_world_size: processes that saved it.
        new_world_size: processes that load it.

    Returns:
        The kept slots; :func:`load_power_sgd_state` leaves the others as built.
    """
    del old_world_size, new_world_size  # the same rule whatever the sizes
    return {key: value for key, value in saved.items() if key in POWER_SGD_KEPT}

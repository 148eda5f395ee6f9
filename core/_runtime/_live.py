"""The live ``Accelerator``: the one Accelerate's process-wide views describe.

Accelerate keeps singletons (``AcceleratorState``, ``GradientState``) that every ``Accelerator``
fills in. kwplug keeps its state per Accelerator; the Accelerate-compatible views
(:mod:`kwplug.state`, ``GradientState()``, ``extract_model_from_parallel``) read the most
recently constructed one still referenced. The Accelerator registers itself here at
construction and the views read it here, so neither imports the other.
"""

from __future__ import annotations

import weakref
from typing import Any

from kwplug.utils.dataclasses import DistributedType

# The most recently constructed Accelerator, weakly: nothing is kept alive for the views.
_live: weakref.ref[Any] | None = None

# What was assigned to ``accelerator.state.distributed_type``, per Accelerator (weakly).
_assigned: weakref.WeakKeyDictionary[Any, DistributedType] = weakref.WeakKeyDictionary()


def register_accelerator(accelerator: Any) -> None:
    """Record ``accelerator`` (weakly) as the live one; called by ``Accelerator.__init__``."""
    global _live
    _live = weakref.ref(accelerator)


def live_accelerator() -> Any:
    """The live Accelerator, or ``None`` (none constructed, collected, or forgotten)."""
    return None if _live is None else _live()


def forget_accelerator() -> None:
    """Forget the live Accelerator (Accelerate's ``_reset_state``); it keeps working."""
    global _live
    _live = None


def assign_distributed_type(accelerator: Any, value: DistributedType) -> None:
    """Make ``value`` what ``accelerator.distributed_type`` reports from now on (Accelerate lets
    scripts assign it on the shared state; no training mechanism changes)."""
    _assigned[accelerator] = value


def assigned_distributed_type(accelerator: Any) -> DistributedType | None:
    """What was assigned for ``accelerator`` (:func:`assign_distributed_type`), or ``None``."""
    return _assigned.get(accelerator)

"""Trustworthy, resumable checkpoints: ``Accelerator.save_state`` / ``load_state``.

One module per concern:

- :mod:`~kwplug.checkpoint.layout`: every name kwplug writes (the layout, described there);
- :mod:`~kwplug.checkpoint.plan`: what a checkpoint holds (one ``Stateful`` per file);
- :mod:`~kwplug.checkpoint.stateful`: adapters to torch's ``Stateful`` protocol, and
  :func:`attach_state` for wrapper plugins' per-rank state;
- :mod:`~kwplug.checkpoint.codec`: state files as safetensors + JSON (no pickles);
- :mod:`~kwplug.checkpoint.manifest`, :mod:`~kwplug.checkpoint.checks`: verification before
  anything is loaded;
- :mod:`~kwplug.checkpoint.commit`, :mod:`~kwplug.checkpoint.lock`: the commit protocol and
  the save lock;
- :mod:`~kwplug.checkpoint.rng`: RNG states; :mod:`~kwplug.checkpoint.sharded`: ``DTensor``
  models and their optimizers;
- :mod:`~kwplug.checkpoint.api`: the ``Accelerator`` methods.
"""

from __future__ import annotations

from kwplug.checkpoint.api import load_state, register_for_checkpointing, save_state
from kwplug.checkpoint.commit import STEPS, is_complete, resolve_checkpoint
from kwplug.checkpoint.errors import CheckpointError
from kwplug.checkpoint.layout import MARKER
from kwplug.checkpoint.stateful import attach_state, attached_states

__all__ = [
    "MARKER",
    "STEPS",
    "CheckpointError",
    "attach_state",
    "attached_states",
    "is_complete",
    "load_state",
    "register_for_checkpointing",
    "resolve_checkpoint",
    "save_state",
]

"""Atomic, resumable checkpoints: ``Accelerator.save_state`` / ``load_state``.

One folder per concern:

- :mod:`~kwplug.checkpoint.layout`: every file name and the marker;
- :mod:`~kwplug.checkpoint.plan`: what a checkpoint holds (one ``Stateful`` per file);
- :mod:`~kwplug.checkpoint.stateful`: adapters to torch's ``Stateful`` protocol, and
  :func:`attach_state` for wrapper plugins' per-rank state;
- :mod:`~kwplug.checkpoint.rng`: RNG states; :mod:`~kwplug.checkpoint.sharded`: ``DTensor``
  models and their optimizers;
- :mod:`~kwplug.checkpoint.commit`: how a checkpoint directory is written, found and replaced;
- :mod:`~kwplug.checkpoint.api`: the ``Accelerator`` methods.
"""

from __future__ import annotations

from kwplug.checkpoint.api import load_state, register_for_checkpointing, save_state
from kwplug.checkpoint.commit import is_complete, resolve_checkpoint
from kwplug.checkpoint.layout import MARKER, PARTIAL_SUFFIX, PREVIOUS_SUFFIX, staging_dir
from kwplug.checkpoint.stateful import attach_state, attached_states

__all__ = [
    "MARKER",
    "PARTIAL_SUFFIX",
    "PREVIOUS_SUFFIX",
    "attach_state",
    "attached_states",
    "is_complete",
    "load_state",
    "register_for_checkpointing",
    "resolve_checkpoint",
    "save_state",
    "staging_dir",
]

"""Trustworthy, resumable checkpoints: ``Accelerator.save_state`` / ``load_state``.

The package never sees the ``Accelerator``: each call is given one frozen
:class:`CheckpointSources` (models, optimizers, loaders, registered objects, ranks...), built
by the Accelerator (:mod:`~kwplug.checkpoint._sources`). One module per concern:

- :mod:`~kwplug.checkpoint._sources`: :class:`CheckpointSources`, what a call is given;

- :mod:`~kwplug.checkpoint._layout`: every name kwplug writes (the layout, described there);
- :mod:`~kwplug.checkpoint._plan`: what a checkpoint holds (one ``Stateful`` per file);
- :mod:`~kwplug.checkpoint._stateful`: adapters to torch's ``Stateful`` protocol, and
  :func:`attach_state` for wrapper plugins' per-rank state;
- :mod:`~kwplug.checkpoint._accumulation`: an unfinished gradient accumulation (per rank);
- :mod:`~kwplug.checkpoint._codec`: state files as safetensors + JSON (no pickles);
- :mod:`~kwplug.checkpoint._manifest`, :mod:`~kwplug.checkpoint._checks`: verification before
  anything is loaded;
- :mod:`~kwplug.checkpoint._commit`, :mod:`~kwplug.checkpoint._lock`: the commit protocol and
  the save lock;
- :mod:`~kwplug.checkpoint._resize`: resuming on another number of processes;
- :mod:`~kwplug.checkpoint._rng`: RNG states; :mod:`~kwplug.checkpoint._sharded`: ``DTensor``
  models and their optimizers;
- :mod:`~kwplug.checkpoint._api`: saving and loading one checkpoint directory;
- :mod:`~kwplug.checkpoint._prehooks`: ``register_save_state_pre_hook`` and
  ``register_load_state_pre_hook`` (user code that saves and loads some models itself);
- :mod:`~kwplug.checkpoint._naming`: automatic checkpoint naming (``checkpoint_<i>``,
  ``total_limit``).
- :mod:`~kwplug.checkpoint._runs`: which run saved a ``checkpoint_<i>`` (two runs in one
  ``project_dir`` never prune or resume each other's).
"""

from __future__ import annotations

from kwplug.checkpoint._api import load_state, save_state
from kwplug.checkpoint._arrival import SaveArrivals
from kwplug.checkpoint._commit import STEPS, is_complete, resolve_checkpoint
from kwplug.checkpoint._layout import MARKER
from kwplug.checkpoint._sources import CheckpointSources
from kwplug.checkpoint._stateful import attach_state, attached_states
from kwplug.errors import CheckpointError

__all__ = [
    "MARKER",
    "STEPS",
    "CheckpointError",
    "CheckpointSources",
    "SaveArrivals",
    "attach_state",
    "attached_states",
    "is_complete",
    "load_state",
    "resolve_checkpoint",
    "save_state",
]

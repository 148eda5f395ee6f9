"""Trustworthy, resumable checkpoints: ``Accelerator.save_state`` / ``load_state``.

The package never sees the ``Accelerator``: each call is given one frozen
:class:`CheckpointSources` (models, optimizers, loaders, registered objects, ranks...), built
by the Accelerator (:mod:`~kwplug.checkpoint._sources`). The Accelerator uses only the names
this face exports, no module of the package (``tests/gates/test_layers.py``):

- :func:`save_state` / :func:`load_state`: one checkpoint directory;
  :func:`save_project_state` / :func:`load_project_state`: ``Accelerator.save_state`` /
  ``load_state`` whole (who saves, automatic naming, ``iteration``, ``total_limit``);
- what the Accelerator builds a call from and keeps across calls: :class:`CheckpointSources`,
  :class:`StatePreHooks` (the registered pre-hooks), :class:`RunIdentity`,
  :class:`SaveArrivals`, :func:`register_for_checkpointing` (the check of the objects given
  to ``register_for_checkpointing``);
- :func:`is_sharded` / :func:`full_model_state`: a ``DTensor`` model's full state dict
  (``get_state_dict``, ``save_model``);
- :func:`attach_state` / :func:`attached_states`: :mod:`kwplug.attached_state`'s, for wrapper
  plugins (which import that module: a plugin never imports this package);
- :func:`load_resized_hooks`: the resize step of a resume on another number of processes,
  for :func:`kwplug.testing.resize_hook_state` (a plugin author's test of a ``resize`` rule).

One module per concern:

- :mod:`~kwplug.checkpoint._sources`: :class:`CheckpointSources`, what a call is given;

- :mod:`~kwplug.checkpoint._layout`: every name kwplug writes (the layout, described there);
- :mod:`~kwplug.checkpoint._plan`: what a checkpoint holds (one ``Stateful`` per file);
- :mod:`~kwplug.checkpoint._stateful`: adapters to torch's ``Stateful`` protocol (the
  per-rank state saves what :func:`attach_state` attached);
- :mod:`~kwplug.checkpoint._accumulation`: an unfinished gradient accumulation (per rank);
- :mod:`~kwplug.checkpoint._codec`: state files as safetensors + JSON (no pickles);
- :mod:`~kwplug.checkpoint._manifest`, :mod:`~kwplug.checkpoint._checks`: verification before
  anything is loaded;
- :mod:`~kwplug.checkpoint._commit`, :mod:`~kwplug.checkpoint._lock`: the commit protocol
  (with its rule: only kwplug's own files, and those a manifest lists, are ever deleted) and
  the save lock;
- :mod:`~kwplug.checkpoint._resize`: resuming on another number of processes;
- :mod:`~kwplug.checkpoint._rng`: RNG states; :mod:`~kwplug.checkpoint._sharded`: ``DTensor``
  models and their optimizers;
- :mod:`~kwplug.checkpoint._api`: saving and loading one checkpoint directory;
- :mod:`~kwplug.checkpoint._prehooks`: ``register_save_state_pre_hook`` and
  ``register_load_state_pre_hook`` (user code that saves and loads some models itself);
- :mod:`~kwplug.checkpoint._naming`: automatic checkpoint naming (``checkpoint_<i>``,
  ``total_limit``).
- :mod:`~kwplug.checkpoint._accelerate_layout`: ``load_state`` of a folder Accelerate wrote
  (``torch.load(weights_only=True)``, NumPy's RNG array allowed, anything else refused);
- :mod:`~kwplug.checkpoint._messages`: Accelerate's ``save_state``/``load_state`` log lines.
- :mod:`~kwplug.checkpoint._runs`: which run saved a ``checkpoint_<i>`` (two runs in one
  ``project_dir`` never prune or resume each other's).
"""

from __future__ import annotations

from kwplug.attached_state import attach_state, attached_states
from kwplug.checkpoint._api import load_state, save_state
from kwplug.checkpoint._arrival import SaveArrivals
from kwplug.checkpoint._commit import STEPS, is_complete, resolve_checkpoint
from kwplug.checkpoint._layout import MARKER
from kwplug.checkpoint._naming import load as load_project_state
from kwplug.checkpoint._naming import save as save_project_state
from kwplug.checkpoint._resize import load_resized_hooks
from kwplug.checkpoint._runs import RunIdentity
from kwplug.checkpoint._sharded import full_model_state, is_sharded
from kwplug.checkpoint._sources import CheckpointSources, StatePreHooks
from kwplug.checkpoint._sources import register as register_for_checkpointing
from kwplug.errors import CheckpointError

__all__ = [
    "MARKER",
    "STEPS",
    "CheckpointError",
    "CheckpointSources",
    "RunIdentity",
    "SaveArrivals",
    "StatePreHooks",
    "attach_state",
    "attached_states",
    "full_model_state",
    "is_complete",
    "is_sharded",
    "load_project_state",
    "load_resized_hooks",
    "load_state",
    "register_for_checkpointing",
    "resolve_checkpoint",
    "save_project_state",
    "save_state",
]

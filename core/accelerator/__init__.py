"""The minimal ``Accelerator``: builds every torch object through the handler hooks.

The package keeps one concern per private module:

- ``_facade``: the public :class:`Accelerator`, each method a delegation; its base classes
  hold the rest of its methods, one concern each: ``_api_prepare``, ``_api_training``,
  ``_api_tracking``, ``_api_saving``, ``_api_process``;
- ``_gradient_state``: the per-Accelerator :class:`GradientState`;
- ``_setup``: resolves arguments, process, device, plugins, comm hooks, autocast factory and
  scaler once, into a frozen object (hooks called through the ``KwplugPluginManager``);
- ``_prepare``: prepares models, optimizers and data loaders and keeps them;
- ``_ops``: collectives (gather, reduce, barrier);
- checkpoints live in their own package, :mod:`kwplug.checkpoint`.

A new concern (gradient accumulation, trackers, more collectives) gets its own private module
and a delegating method on the facade; collectives go to ``_ops``.
"""

from __future__ import annotations

import importlib
from typing import Any

from kwplug._contracts.lazy import BUILTIN_HANDLERS
from kwplug.accelerator._facade import Accelerator
from kwplug.precision import MIXED_PRECISION

# Documented, pickled and shown under its public path.
Accelerator.__module__ = __name__

# Scripts import these from ``accelerate.accelerator`` too (Accelerate's shipped test scripts
# do): served from their one home, lazily, so that importing this package stays cheap.
_REEXPORTS = {
    "AcceleratorState": "kwplug.state",
    "PartialState": "kwplug.state",
    "GradientState": "kwplug.state",
    "RNGType": "kwplug.utils",
    "DataLoaderConfiguration": "kwplug.utils",
    "GradientAccumulationPlugin": "kwplug.utils",
    "ProjectConfiguration": "kwplug.utils",
    "DistributedType": "kwplug.utils",
    "DynamoBackend": "kwplug.utils",
    "TorchDynamoPlugin": "kwplug.utils",
    "AORecipeKwargs": "kwplug.utils",  # importable; building one raises (no FP8)
    "TERecipeKwargs": "kwplug.utils",
    **dict.fromkeys(BUILTIN_HANDLERS, "kwplug"),
    "FullyShardedDataParallelPlugin": "kwplug",
    "ParallelismConfig": "kwplug",
    "KwargsHandler": "kwplug",
}


def __getattr__(name: str) -> Any:
    module = _REEXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = ["MIXED_PRECISION", "Accelerator"]

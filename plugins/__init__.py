"""kwplug's built-in handler plugins, one module each.

Each is an attrs :class:`~kwplug.KwargsHandler` whose ``@kwplug.hookimpl`` methods answer one
hook. They are registered through kwplug's own ``kwplug.handlers`` entry points, exactly as a
third-party plugin is.

Nothing is imported here eagerly: the names below are resolved on first access (PEP 562), so
loading one built-in entry point imports that module only, and a blocked built-in is never
imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, for type checkers (explicit re-exports)
    from kwplug.plugins.aim_tracker import AimTracker as AimTracker
    from kwplug.plugins.autocast import AutocastKwargs as AutocastKwargs
    from kwplug.plugins.comet_ml_tracker import CometMLTracker as CometMLTracker
    from kwplug.plugins.ddp import DDPCommunicationHookType as DDPCommunicationHookType
    from kwplug.plugins.ddp import DistributedDataParallelKwargs as DistributedDataParallelKwargs
    from kwplug.plugins.dynamo import DynamoBackend as DynamoBackend
    from kwplug.plugins.dynamo import TorchDynamoPlugin as TorchDynamoPlugin
    from kwplug.plugins.fsdp import (
        FullyShardedDataParallelPlugin as FullyShardedDataParallelPlugin,
    )
    from kwplug.plugins.grad_scaler import GradScalerKwargs as GradScalerKwargs
    from kwplug.plugins.mlflow_tracker import MLflowTracker as MLflowTracker
    from kwplug.plugins.parallelism import ParallelismConfig as ParallelismConfig
    from kwplug.plugins.process_group import InitProcessGroupKwargs as InitProcessGroupKwargs
    from kwplug.plugins.profile import ProfileKwargs as ProfileKwargs
    from kwplug.plugins.trackers import JSONLinesTracker as JSONLinesTracker
    from kwplug.plugins.trackers import TensorBoardTracker as TensorBoardTracker
    from kwplug.plugins.wandb_tracker import WandBTracker as WandBTracker

#: Re-exported name -> the module (in this package) defining it; the one list of the
#: names at run time (``__all__`` derives from it).
_EXPORTS: dict[str, str] = {
    "AutocastKwargs": ".autocast",
    "DDPCommunicationHookType": ".ddp",
    "DistributedDataParallelKwargs": ".ddp",
    "DynamoBackend": ".dynamo",
    "TorchDynamoPlugin": ".dynamo",
    "FullyShardedDataParallelPlugin": ".fsdp",
    "ParallelismConfig": ".parallelism",
    "GradScalerKwargs": ".grad_scaler",
    "InitProcessGroupKwargs": ".process_group",
    "ProfileKwargs": ".profile",
    "JSONLinesTracker": ".trackers",
    "TensorBoardTracker": ".trackers",
    "WandBTracker": ".wandb_tracker",
    "MLflowTracker": ".mlflow_tracker",
    "CometMLTracker": ".comet_ml_tracker",
    "AimTracker": ".aim_tracker",
}

__all__ = sorted(_EXPORTS)


# This package is held to a third-party plugin's rules (public kwplug names only), so its
# PEP 562 look-up is its own rather than the core's private ``kwplug._contracts.lazy``.
def __getattr__(name: str) -> Any:
    """Import the module defining ``name`` (from :data:`_EXPORTS`) on first use and keep the
    value here, so that later look-ups skip this function.

    Raises:
        AttributeError: ``name`` is not one of this package's exports.
    """
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The exported names and the dunder names (as ``kwplug``'s and ``kwplug.utils``' own)."""
    return sorted({*__all__, *(n for n in globals() if n.startswith("__"))})

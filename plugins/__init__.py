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

if TYPE_CHECKING:
    from kwplug.plugins.autocast import AutocastKwargs
    from kwplug.plugins.ddp import DDPCommunicationHookType, DistributedDataParallelKwargs
    from kwplug.plugins.grad_scaler import GradScalerKwargs
    from kwplug.plugins.process_group import InitProcessGroupKwargs
    from kwplug.plugins.profile import ProfileKwargs
    from kwplug.plugins.trackers import JSONLinesTracker, TensorBoardTracker

#: Re-exported name -> the module (in this package) defining it.
_EXPORTS: dict[str, str] = {
    "AutocastKwargs": "autocast",
    "DDPCommunicationHookType": "ddp",
    "DistributedDataParallelKwargs": "ddp",
    "GradScalerKwargs": "grad_scaler",
    "InitProcessGroupKwargs": "process_group",
    "ProfileKwargs": "profile",
    "JSONLinesTracker": "trackers",
    "TensorBoardTracker": "trackers",
}

__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "JSONLinesTracker",
    "ProfileKwargs",
    "TensorBoardTracker",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

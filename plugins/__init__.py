"""kwplug's built-in handler plugins, one module each.

Each is an attrs :class:`~kwplug.KwargsHandler` whose ``@kwplug.hookimpl`` methods answer one
hook. They are registered through kwplug's own ``kwplug.handlers`` entry points, exactly as a
third-party plugin is.
"""

from kwplug.plugins.autocast import AutocastKwargs
from kwplug.plugins.ddp import DDPCommunicationHookType, DistributedDataParallelKwargs
from kwplug.plugins.grad_scaler import GradScalerKwargs
from kwplug.plugins.process_group import InitProcessGroupKwargs
from kwplug.plugins.profile import ProfileKwargs

__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "ProfileKwargs",
]

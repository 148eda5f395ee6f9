"""kwplug: pluggable kwargs handlers for PyTorch training.

The core defines the hook contract (:mod:`kwplug.hookspecs`), the :class:`KwargsHandler` base,
entry-point discovery (:func:`discover`), the exceptions (:mod:`kwplug.errors`) and a minimal
:class:`Accelerator`. The built-in handlers live in :mod:`kwplug.plugins` and are re-exported
here lazily, so ``import kwplug`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kwplug._plugins import Answer, discover
from kwplug.accelerator import Accelerator
from kwplug.comm_hooks import CommHook, register_comm_hook, unregister_comm_hook
from kwplug.errors import PluginLoadError, PluginLoadWarning
from kwplug.handler import KwargsHandler
from kwplug.hookspecs import hookimpl, hookspec

if TYPE_CHECKING:
    from kwplug.plugins import (
        AutocastKwargs,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ProfileKwargs,
    )
    from kwplug.utils import (
        DataLoaderConfiguration,
        DistributedType,
        find_executable_batch_size,
        is_rich_available,
    )

__all__ = [
    "Accelerator",
    "Answer",
    "AutocastKwargs",
    "CommHook",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "PluginLoadError",
    "PluginLoadWarning",
    "ProfileKwargs",
    "__version__",
    "discover",
    "find_executable_batch_size",
    "hookimpl",
    "hookspec",
    "is_rich_available",
    "register_comm_hook",
    "unregister_comm_hook",
]

_BUILTIN_REEXPORTS = frozenset(
    {
        "AutocastKwargs",
        "DDPCommunicationHookType",
        "DistributedDataParallelKwargs",
        "GradScalerKwargs",
        "InitProcessGroupKwargs",
        "ProfileKwargs",
    }
)

# What ``accelerate`` itself (not ``accelerate.utils``) exports from its utils, for
# ``from accelerate import Accelerator, DistributedType`` to port by renaming the package.
_UTILS_REEXPORTS = frozenset(
    {
        "DataLoaderConfiguration",
        "DistributedType",
        "find_executable_batch_size",
        "is_rich_available",
    }
)


def __getattr__(name: str) -> Any:
    if name == "__version__":  # from the installed metadata; read lazily, import stays cheap
        import importlib_metadata

        return importlib_metadata.version("kwplug")
    # Re-export only: the core itself never refers to a built-in handler class.
    if name in _BUILTIN_REEXPORTS:
        from kwplug import plugins

        return getattr(plugins, name)
    if name in _UTILS_REEXPORTS:
        from kwplug import utils

        return getattr(utils, name)
    raise AttributeError(f"module 'kwplug' has no attribute {name!r}")

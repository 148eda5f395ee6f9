"""kwplug: pluggable kwargs handlers for PyTorch training.

The core defines the hook contract (:mod:`kwplug.hookspecs`), the :class:`KwargsHandler` base,
entry-point discovery (:func:`discover`), the exceptions (:mod:`kwplug.errors`) and a minimal
:class:`Accelerator`. The built-in handlers live in :mod:`kwplug.plugins`.

Every public name is listed once, in :data:`_EXPORTS`, with the module that defines it, and
is imported on first use (PEP 562), so ``import kwplug`` imports none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kwplug._contracts.lazy import BUILTIN_HANDLERS, exporter

if TYPE_CHECKING:  # the same names, for type checkers (explicit re-exports)
    from kwplug._plugins import Answer as Answer
    from kwplug._plugins import discover as discover
    from kwplug.accelerator import Accelerator as Accelerator
    from kwplug.big_modeling import cpu_offload_with_hook as cpu_offload_with_hook
    from kwplug.big_modeling import init_empty_weights as init_empty_weights
    from kwplug.big_modeling import init_on_device as init_on_device
    from kwplug.big_modeling import load_checkpoint_and_dispatch as load_checkpoint_and_dispatch
    from kwplug.comm_hooks import CommHook as CommHook
    from kwplug.comm_hooks import register_comm_hook as register_comm_hook
    from kwplug.comm_hooks import unregister_comm_hook as unregister_comm_hook
    from kwplug.errors import PluginLoadError as PluginLoadError
    from kwplug.errors import PluginLoadWarning as PluginLoadWarning
    from kwplug.handler import KwargsHandler as KwargsHandler
    from kwplug.hookspecs import hookimpl as hookimpl
    from kwplug.hookspecs import hookspec as hookspec
    from kwplug.launchers import debug_launcher as debug_launcher
    from kwplug.launchers import notebook_launcher as notebook_launcher
    from kwplug.plugins import AutocastKwargs as AutocastKwargs
    from kwplug.plugins import DDPCommunicationHookType as DDPCommunicationHookType
    from kwplug.plugins import DistributedDataParallelKwargs as DistributedDataParallelKwargs
    from kwplug.plugins import FullyShardedDataParallelPlugin as FullyShardedDataParallelPlugin
    from kwplug.plugins import GradScalerKwargs as GradScalerKwargs
    from kwplug.plugins import InitProcessGroupKwargs as InitProcessGroupKwargs
    from kwplug.plugins import ParallelismConfig as ParallelismConfig
    from kwplug.plugins import ProfileKwargs as ProfileKwargs
    from kwplug.state import AcceleratorState as AcceleratorState
    from kwplug.state import PartialState as PartialState
    from kwplug.utils import DataLoaderConfiguration as DataLoaderConfiguration
    from kwplug.utils import DistributedType as DistributedType
    from kwplug.utils import find_executable_batch_size as find_executable_batch_size
    from kwplug.utils import is_rich_available as is_rich_available
    from kwplug.utils.modeling import infer_auto_device_map as infer_auto_device_map
    from kwplug.utils.modeling import load_checkpoint_in_model as load_checkpoint_in_model

#: Public name -> the module that defines it. The handlers are re-exported from
#: :mod:`kwplug.plugins` (the core never refers to a built-in class), and the ``accelerate``
#: top-level names that come from its utils from :mod:`kwplug.utils`, so that
#: ``from accelerate import Accelerator, DistributedType`` ports by renaming the package.
_EXPORTS: dict[str, str] = {
    "Accelerator": "kwplug.accelerator",
    "Answer": "kwplug._plugins",
    "discover": "kwplug._plugins",
    "cpu_offload_with_hook": "kwplug.big_modeling",
    "init_empty_weights": "kwplug.big_modeling",
    "init_on_device": "kwplug.big_modeling",
    "load_checkpoint_and_dispatch": "kwplug.big_modeling",
    "infer_auto_device_map": "kwplug.utils.modeling",
    "load_checkpoint_in_model": "kwplug.utils.modeling",
    "CommHook": "kwplug.comm_hooks",
    "register_comm_hook": "kwplug.comm_hooks",
    "unregister_comm_hook": "kwplug.comm_hooks",
    "PluginLoadError": "kwplug.errors",
    "PluginLoadWarning": "kwplug.errors",
    "KwargsHandler": "kwplug.handler",
    "hookimpl": "kwplug.hookspecs",
    "hookspec": "kwplug.hookspecs",
    "debug_launcher": "kwplug.launchers",
    "notebook_launcher": "kwplug.launchers",
    **dict.fromkeys(BUILTIN_HANDLERS, "kwplug.plugins"),
    "DDPCommunicationHookType": "kwplug.plugins",
    "FullyShardedDataParallelPlugin": "kwplug.plugins",
    "ParallelismConfig": "kwplug.plugins",
    "AcceleratorState": "kwplug.state",
    "PartialState": "kwplug.state",
    "DataLoaderConfiguration": "kwplug.utils",
    "DistributedType": "kwplug.utils",
    "find_executable_batch_size": "kwplug.utils",
    "is_rich_available": "kwplug.utils",
}

__all__ = sorted([*_EXPORTS, "__version__"])


_lazy_getattr, __dir__ = exporter(globals(), _EXPORTS)


def __getattr__(name: str) -> Any:
    if name == "__version__":  # from the installed metadata, read on first use
        import importlib_metadata

        return importlib_metadata.version("kwplug")
    return _lazy_getattr(name)

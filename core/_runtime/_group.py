"""Process-group set-up: the one way kwplug creates torch's default process group, for an
``Accelerator`` and for :class:`kwplug.state.PartialState` alike (Accelerate creates it in its
shared state; kwplug through the plugins' ``init_process_group`` hook)."""

from __future__ import annotations

import atexit
import functools
from typing import TYPE_CHECKING

import torch.distributed as dist

from kwplug._process.environment import ProcessInfo, end_process_group

if TYPE_CHECKING:
    from kwplug._plugins import KwplugPluginManager


def init_process_group(
    plugins: KwplugPluginManager, info: ProcessInfo, device_type: str
) -> ProcessInfo:
    """Create the default process group through the plugins' ``init_process_group`` hook
    (the built-in ``InitProcessGroupKwargs`` calls ``torch.distributed.init_process_group``)
    and destroy it when the interpreter exits.

    Args:
        plugins: the manager whose plugins are asked (an Accelerator's, or one without user
            handlers).
        info: the ranks torchrun's variables give (``WORLD_SIZE > 1``).
        device_type: the type of the device this process trains on (picks the backend).

    Returns:
        The ranks read again from the new group.

    Raises:
        RuntimeError: no plugin created the group (the built-in plugin may be blocked).
    """
    done = plugins.first.init_process_group(
        device_type=device_type,
        world_size=info.world_size,
        rank=info.rank,
        local_rank=info.local_rank,
    )
    if not done or not dist.is_initialized():
        raise RuntimeError(
            f"WORLD_SIZE={info.world_size} but no plugin initialised the process group "
            "(the built-in InitProcessGroupKwargs plugin may be blocked)"
        )
    destroy_process_group_at_exit()
    return ProcessInfo.current()


@functools.cache
def destroy_process_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits (registered once per
    process; a no-op when ``end_training()`` already destroyed it)."""
    # atexit runs before interpreter teardown frees gloo's objects in an arbitrary order.
    atexit.register(end_process_group)

"""What the ``Accelerator`` (:mod:`kwplug.accelerator`) and Accelerate's module names on top
of it (:mod:`kwplug.state`, :mod:`kwplug.data_loader`, :mod:`kwplug.utils.other`,
:mod:`kwplug.logging`) both need, below both, so that imports run one way: the upper layer
imports this package and the Accelerator, the Accelerator imports this package, and nothing
here imports either (``tests/gates/test_layers.py``).

- ``_ranks``: :class:`Ranks`, the rank predicates and "which process runs what"; the barrier.
- ``_meet``: bounded meetings of every rank through the c10d store (``KWPLUG_RANK_WAIT``).
- ``_device``: the device, from the plugins' ``select_device`` hook or the built-in choice.
- ``_group``: process-group set-up through the plugins' ``init_process_group`` hook.
- ``_live``: the live Accelerator that Accelerate's process-wide views describe.
- ``_forward``: the mixed-precision forward ``prepare`` installs, and its removal.
- ``_serialize``: one object to one file (``Accelerator.save``, ``kwplug.utils.save``).
- ``_unwrap``: the model inside its wrappers (``unwrap_model``,
  ``extract_model_from_parallel``).
"""

from __future__ import annotations

from kwplug._runtime._device import Device, choose_device
from kwplug._runtime._forward import apply_mixed_precision, remove_mixed_precision
from kwplug._runtime._group import destroy_process_group_at_exit, init_process_group
from kwplug._runtime._live import (
    assign_distributed_type,
    assigned_distributed_type,
    forget_accelerator,
    live_accelerator,
    register_accelerator,
)
from kwplug._runtime._meet import WAIT_VARIABLE as RANK_WAIT_VARIABLE
from kwplug._runtime._meet import default_store, meet, rank_wait
from kwplug._runtime._meet import wait as wait_for_ranks
from kwplug._runtime._ranks import (
    Ranks,
    decorated,
    goes_first,
    run_if,
    split_between_processes,
    wait_for_everyone,
)
from kwplug._runtime._serialize import dedupe_shared, storage_key, write
from kwplug._runtime._unwrap import unwrap

__all__ = [
    "RANK_WAIT_VARIABLE",
    "Device",
    "Ranks",
    "apply_mixed_precision",
    "assign_distributed_type",
    "assigned_distributed_type",
    "choose_device",
    "decorated",
    "dedupe_shared",
    "default_store",
    "destroy_process_group_at_exit",
    "forget_accelerator",
    "goes_first",
    "init_process_group",
    "live_accelerator",
    "meet",
    "rank_wait",
    "register_accelerator",
    "remove_mixed_precision",
    "run_if",
    "split_between_processes",
    "storage_key",
    "unwrap",
    "wait_for_everyone",
    "wait_for_ranks",
    "write",
]

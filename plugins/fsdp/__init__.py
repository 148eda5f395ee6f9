"""The ``fsdp`` plugin: :class:`FullyShardedDataParallelPlugin`, FSDP2 (torch's
``fully_shard``) behind Accelerate's ``Accelerator(fsdp_plugin=...)``."""

from __future__ import annotations

from kwplug.plugins.fsdp._plugin import FullyShardedDataParallelPlugin

__all__ = ["FullyShardedDataParallelPlugin"]

"""The ``parallelism`` plugin: :class:`ParallelismConfig`, one device mesh for data
parallelism, FSDP2/HSDP and tensor parallelism (Accelerate's ``ParallelismConfig``)."""

from __future__ import annotations

from kwplug.plugins.parallelism._config import ParallelismConfig

__all__ = ["ParallelismConfig"]

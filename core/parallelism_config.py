"""``from accelerate.parallelism_config import ParallelismConfig`` ports by renaming the
package: ``ParallelismConfig`` is the built-in ``parallelism`` plugin's handler
(:class:`kwplug.plugins.parallelism.ParallelismConfig`), loaded on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kwplug._contracts.lazy import exporter

if TYPE_CHECKING:
    from kwplug.plugins.parallelism import ParallelismConfig as ParallelismConfig

__all__ = ["ParallelismConfig"]

__getattr__, __dir__ = exporter(globals(), {"ParallelismConfig": "kwplug.plugins.parallelism"})

"""The Accelerator's trackers and model-saving methods (a base class of ``Accelerator``):
trackers through :mod:`._tracking`, files through :mod:`._saving`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from kwplug._plugins import KwplugPluginManager
from kwplug.accelerator import _saving
from kwplug.accelerator._tracking import _Trackers
from kwplug.tracking import GeneralTracker
from kwplug.utils.dataclasses import ProjectConfiguration


class _TrackersAndSaving:
    """``init_trackers``/``log``/``get_tracker`` and ``save``/``save_model``/``get_state_dict``/
    ``unwrap_model`` of the Accelerator."""

    _trackers: _Trackers
    plugin_manager: KwplugPluginManager
    project_configuration: ProjectConfiguration
    process_index: int
    local_process_index: int

    @property
    def trackers(self) -> list[GeneralTracker]:
        """The trackers :meth:`init_trackers` started (none off the main process)."""
        return list(self._trackers.started)

    def init_trackers(
        self, project_name: str, config: Mapping[str, Any] | None = None, init_kwargs: Any = None
    ) -> None:
        """Start the ``log_with`` trackers on the main process, store ``config`` in each;
        ``init_kwargs[name]`` goes to that tracker's factory (see :mod:`kwplug.tracking`)."""
        self._trackers.init(project_name, config, init_kwargs)

    def log(
        self, values: Mapping[str, Any], step: int | None = None, log_kwargs: Any = None
    ) -> None:
        """Log ``values`` at ``step`` to every started tracker (main process only);
        ``log_kwargs[name]`` goes to that tracker's ``log``."""
        self._trackers.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker ``name`` (its ``tracker`` object when ``unwrap``); a do-nothing
        ``GeneralTracker`` off the main process. Raises ``ValueError`` for an unknown name."""
        return self._trackers.get(name, unwrap)

    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True
    ) -> torch.nn.Module:
        """The user's module inside torch's wrappers and plugins' (``unwrap_model`` hook);
        ``keep_fp32_wrapper`` is Accelerate's (kwplug never patches ``forward``)."""
        return _saving.unwrap(model, self.plugin_manager)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The full state dict (a sharded model's gathered to rank 0, on the CPU)."""
        return _saving.get_state_dict(model, self.plugin_manager, unwrap)

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """``torch.save`` (or safetensors) on the main process (each node's with
        ``save_on_each_node``)."""
        if self._writes_files:
            _saving.save(obj, f, safe_serialization)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Save the weights as Accelerate does (same files, same tensors; see
        :mod:`kwplug.accelerator._saving`). Every rank calls it; the main process writes."""
        state_dict = self.get_state_dict(model)
        if self._writes_files:
            _saving.save_model(state_dict, save_directory, max_shard_size, safe_serialization)

    @property
    def _writes_files(self) -> bool:
        config = self.project_configuration
        index = self.local_process_index if config.save_on_each_node else self.process_index
        return index == 0

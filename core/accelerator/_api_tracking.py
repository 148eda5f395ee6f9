"""The Accelerator's tracker methods (a base class of ``Accelerator``): ``trackers``,
``init_trackers``, ``log``, ``get_tracker`` and ``logging_dir``, through :mod:`._tracking`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kwplug.accelerator._tracking import _Trackers
from kwplug.tracking import GeneralTracker
from kwplug.utils.dataclasses import ProjectConfiguration


class _TrackingAPI:
    """``trackers``, ``init_trackers``/``log``/``get_tracker`` and ``logging_dir`` of the
    Accelerator (trackers exist on the main process only)."""

    _trackers: _Trackers
    project_configuration: ProjectConfiguration

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

    @property
    def logging_dir(self) -> str | None:
        """``project_configuration.logging_dir``: the folder for trackers' logs, or ``None``."""
        return self.project_configuration.logging_dir

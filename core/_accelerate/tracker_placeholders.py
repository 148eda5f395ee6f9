"""Accelerate's tracker classes that kwplug has no plugin for (``ClearMLTracker``,
``DVCLiveTracker``, ``SwanLabTracker``, ``TrackioTracker``), under their names in
:mod:`kwplug.tracking`, so that code importing them imports; building one raises
``NotImplementedError`` naming its row of docs/migrating-from-accelerate.md. A tracker for one
of these services is a plugin answering the ``trackers`` hook (see docs/trackers.md)."""

from __future__ import annotations

from typing import Any, ClassVar

from kwplug.tracking import GeneralTracker

__all__ = ["ClearMLTracker", "DVCLiveTracker", "SwanLabTracker", "TrackioTracker"]


class _Placeholder(GeneralTracker):
    """A tracker kwplug does not ship: ``is_available()`` is ``False`` and building it raises
    ``NotImplementedError``."""

    requires_logging_directory: ClassVar[bool] = False

    def __init__(self, run_name: str | None = None, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"{type(self).__name__}: kwplug has no {self.name!r} tracker; see the "
            f"`accelerate.tracking.{type(self).__name__}` row of "
            "docs/migrating-from-accelerate.md (a tracker plugin can provide one)"
        )

    @property
    def tracker(self) -> Any:
        """Never reached: building one raises."""
        return None

    @classmethod
    def is_available(cls) -> bool:
        """``False``: kwplug has no such tracker."""
        return False


class ClearMLTracker(_Placeholder):
    """Not supported (Accelerate's ClearML tracker)."""

    name: ClassVar[str] = "clearml"


class DVCLiveTracker(_Placeholder):
    """Not supported (Accelerate's DVCLive tracker)."""

    name: ClassVar[str] = "dvclive"

    def __init__(self, run_name: str | None = None, live: Any = None, **kwargs: Any) -> None:
        super().__init__(run_name, **kwargs)


class SwanLabTracker(_Placeholder):
    """Not supported (Accelerate's SwanLab tracker)."""

    name: ClassVar[str] = "swanlab"

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__(run_name, **kwargs)


class TrackioTracker(_Placeholder):
    """Not supported (Accelerate's Trackio tracker)."""

    name: ClassVar[str] = "trackio"

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__(run_name, **kwargs)

"""``log_with="dvclive"`` for kwplug: a third-party tracker plugin built on kwplug's public API.

Installed, this module is the plugin object of the entry point ``dvclive`` (group
``kwplug.handlers``); its ``trackers`` hook gives the tracker ``"dvclive"``,
:class:`DVCLiveTracker`, which writes DVCLive's local files: ``params.yaml``,
``metrics.json`` (the latest values) and ``plots/metrics/<name>.tsv`` (one row per step) in
its folder (``dvclive/`` unless ``init_kwargs={"dvclive": {"dir": ...}}`` says otherwise).
Nothing leaves the machine; inside a DVC repository each run is also a DVC experiment.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import kwplug
from kwplug.tracking import (
    GeneralTracker,
    TrackerFactory,
    import_tracker_package,
    package_installed,
    plain_value,
)

__all__ = ["DVCLiveTracker", "trackers"]


class DVCLiveTracker(GeneralTracker):
    """Logs to a ``dvclive.Live`` (the arguments of Accelerate's ``DVCLiveTracker``).

    Args:
        run_name: the project name given to ``init_trackers`` (DVCLive has no project name;
            kept as ``run_name``).
        live: a ``dvclive.Live`` to log to instead of creating one, default ``None``.
        kwargs: passed to ``dvclive.Live`` (``dir``, ``save_dvc_exp``, ``report``...), from
            ``init_kwargs["dvclive"]``.
    """

    name: ClassVar[str] = "dvclive"
    requires_logging_directory: ClassVar[bool] = False
    requirement: ClassVar[str | None] = "kwplug-dvclive"

    def __init__(self, run_name: str | None = None, live: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.live = live
        self.init_kwargs = kwargs
        self._dropped: set[str] = set()

    @classmethod
    def is_available(cls) -> bool:
        """Whether the ``dvclive`` package is installed."""
        return package_installed("dvclive")

    @property
    def tracker(self) -> Any:
        """The ``dvclive.Live`` (``None`` before :meth:`start`)."""
        return self.live

    def start(self) -> None:
        """Create the ``dvclive.Live`` (unless one was given).

        Raises:
            ModuleNotFoundError: ``dvclive`` is not installed (names ``pip install
                kwplug-dvclive``).
        """
        if self.live is None:
            dvclive = import_tracker_package("dvclive", self.name, "kwplug-dvclive")
            self.live = dvclive.Live(**self.init_kwargs)

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Write ``values`` to ``params.yaml`` (``Live.log_params``; nested dicts and lists
        stay as they are, one-element tensors become numbers)."""
        self.live.log_params({str(k): plain_value(v) for k, v in values.items()})

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log each number in ``values`` at ``step`` (``Live.log_metric``), then close the step
        (``Live.next_step``: ``metrics.json`` updated).

        Values DVCLive cannot plot (strings, dicts) are left out with one ``UserWarning`` per
        key.

        Args:
            values: metric name -> number (one-element tensors included).
            step: the step (``Live.step``), or ``None`` for DVCLive's own counter.
            kwargs: passed to ``Live.log_metric`` (``timestamp``, ``plot``).
        """
        if step is not None:
            self.live.step = step
        for key, value in values.items():
            value = plain_value(value)
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                self.live.log_metric(key, value, **kwargs)
            elif key not in self._dropped:
                self._dropped.add(key)
                warnings.warn(
                    f"dvclive: {key!r} is a {type(value).__name__}, not a number; it was not "
                    "logged",
                    UserWarning,
                    stacklevel=2,
                )
        self.live.next_step()

    def log_images(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Save each image (NumPy array, PIL image, matplotlib figure or file path) under
        ``plots/images/<key>`` (``Live.log_image``; ``step`` is DVCLive's current step)."""
        if step is not None:
            self.live.step = step
        for key, image in values.items():
            self.live.log_image(key, image, **kwargs)

    def finish(self) -> None:
        """End the run (``Live.end``: the summary and, in a DVC repository, the experiment)."""
        if self.live is not None:
            self.live.end()


@kwplug.hookimpl
def trackers() -> Mapping[str, TrackerFactory]:
    """The ``"dvclive"`` tracker."""
    return {DVCLiveTracker.name: DVCLiveTracker}

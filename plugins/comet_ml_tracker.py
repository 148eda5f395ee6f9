"""The Comet tracker (``log_with="comet_ml"``), a plugin of its own.

This module is a plugin object (entry point ``comet_ml`` of the ``kwplug.handlers`` group)
whose ``trackers`` hook gives ``"comet_ml"``: :class:`CometMLTracker`. It needs the
``kwplug[comet_ml]`` extra; without it the plugin still loads (``comet_ml`` is imported only
when a run starts), ``log_with="all"`` leaves it out, and ``log_with="comet_ml"`` fails at
``init_trackers`` with a message naming the extra.

Offline runs (no API key, no network): ``init_kwargs={"comet_ml": {"online": False}}`` (or
Comet's ``COMET_START_ONLINE=false``); the run is archived as a ``.zip`` in
``COMET_OFFLINE_DIRECTORY`` (default ``.cometml-runs``), uploaded later with ``comet upload``.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, ClassVar

from kwplug.hookspecs import hookimpl
from kwplug.plugins._client_tracker import ClientTracker
from kwplug.tracking import TrackerFactory, plain_value

__all__ = ["CometMLTracker", "trackers"]


class CometMLTracker(ClientTracker):
    """Logs to a Comet experiment (``comet_ml.start``), as Accelerate's ``CometMLTracker``.

    The project is the name given to ``init_trackers``; everything in
    ``init_kwargs["comet_ml"]`` goes to ``comet_ml.start`` (``workspace``, ``online``,
    ``experiment_key``, ``mode``...). The configuration becomes the experiment's parameters
    (nested dicts as ``outer|inner``, Comet's own flattening); each :meth:`log` sends numbers
    as metrics at the step, strings as "other" values and dicts of numbers as metrics.

    Args:
        run_name: the project name given to ``init_trackers`` (``project_name``).
        kwargs: passed to ``comet_ml.start``.
    """

    name: ClassVar[str] = "comet_ml"
    package: ClassVar[str] = "comet_ml"
    requirement: ClassVar[str | None] = "kwplug[comet_ml]"
    close_method: ClassVar[str] = "end"  # flushes, or writes the offline archive

    def start(self) -> None:
        """Start (or resume) the experiment: ``comet_ml.start(project_name=run_name, ...)``.

        Raises:
            ModuleNotFoundError: ``comet_ml`` is not installed (the message names
                ``pip install 'kwplug[comet_ml]'``).
        """
        comet_ml = self.client()
        self.writer = comet_ml.start(project_name=self.run_name, **self.init_kwargs)

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """``experiment.log_parameters(values)`` (one-element tensors as numbers)."""
        self.writer.log_parameters(self.plain(values))

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log each value by type at ``step``: numbers with ``log_metric``, strings with
        ``log_other``, dicts with ``log_metrics``; other values are not sent (as Accelerate).

        Args:
            values: metric name -> number (one-element tensors included), string or dict.
            step: the step (``experiment.set_step``), or ``None``.
            kwargs: passed to each ``log_*`` call, from ``log_kwargs["comet_ml"]``.
        """
        if step is not None:
            self.writer.set_step(step)
        for key, value in values.items():
            value = plain_value(value)
            if isinstance(value, numbers.Number):
                self.writer.log_metric(key, value, step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.log_other(key, value, **kwargs)
            elif isinstance(value, Mapping):
                self.writer.log_metrics(self.plain(value), step=step, **kwargs)


@hookimpl
def trackers() -> Mapping[str, TrackerFactory]:
    """The ``"comet_ml"`` tracker."""
    return {CometMLTracker.name: CometMLTracker}

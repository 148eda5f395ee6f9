"""The MLflow tracker (``log_with="mlflow"``), a plugin of its own.

This module is a plugin object (entry point ``mlflow`` of the ``kwplug.handlers`` group) whose
``trackers`` hook gives ``"mlflow"``: :class:`MLflowTracker`. It needs the ``kwplug[mlflow]``
extra (``mlflow``; the lighter ``mlflow-skinny`` client is enough to log, the full package
adds ``mlflow ui``); without it the plugin still loads, ``log_with="all"`` leaves it out, and
``log_with="mlflow"`` fails at ``init_trackers`` with a message naming the extra.

Where runs go is MLflow's own setting: ``MLFLOW_TRACKING_URI`` (e.g. ``file:./mlruns`` for a
local folder, or a server's URL), ``init_kwargs={"mlflow": {"tracking_uri": ...}}``, or
MLflow's default.
"""

from __future__ import annotations

import json
import numbers
import os
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

from kwplug.errors import TrackerConfigWarning
from kwplug.hookspecs import hookimpl
from kwplug.tracking import (
    GeneralTracker,
    TrackerFactory,
    import_tracker_package,
    package_installed,
    plain_value,
)

__all__ = ["MLflowTracker", "trackers"]

_EXTRA = "kwplug[mlflow]"
#: MLflow's limits (``mlflow.utils.validation``): longest parameter value, most per batch.
_MAX_PARAM_LENGTH = 6000
_PARAMS_PER_BATCH = 100


class MLflowTracker(GeneralTracker):
    """Logs to an MLflow run, as Accelerate's ``MLflowTracker`` (same arguments and
    environment variables).

    The experiment is the name given to ``init_trackers`` (created when missing); the run is
    started with ``mlflow.start_run`` and so is MLflow's active run (``mlflow.log_artifact``
    in the training script goes to it). The configuration becomes the run's parameters,
    each :meth:`log`'s numbers its metrics at the given step.

    As in Accelerate, these environment variables win over the arguments:
    ``MLFLOW_EXPERIMENT_NAME``, ``MLFLOW_RUN_ID``, ``MLFLOW_TAGS`` (a JSON object) and
    ``MLFLOW_NESTED_RUN``.

    Args:
        experiment_name: the experiment (``init_trackers``' project name); ``None``: MLflow's
            default experiment.
        logging_dir: ``str`` or ``os.PathLike``, the artifact location of an experiment this
            tracker creates (default ``None``: MLflow's).
        run_id: resume this run instead of starting a new one, default ``None``.
        tags: ``dict`` of tags (or a JSON string of one) for the run and a created experiment.
        nested_run: start the run nested in the active one, default ``False``.
        run_name: the run's name (``mlflow.runName``), default ``None`` (MLflow picks one).
        description: the run's description, default ``None``.
        tracking_uri: ``mlflow.set_tracking_uri`` before starting (a process-wide MLflow
            setting), default ``None``: ``MLFLOW_TRACKING_URI`` or MLflow's default.
    """

    name: ClassVar[str] = "mlflow"
    requires_logging_directory: ClassVar[bool] = False
    requirement: ClassVar[str | None] = _EXTRA

    def __init__(
        self,
        experiment_name: str | None = None,
        logging_dir: str | os.PathLike[str] | None = None,
        run_id: str | None = None,
        tags: Mapping[str, Any] | str | None = None,
        nested_run: bool = False,
        run_name: str | None = None,
        description: str | None = None,
        tracking_uri: str | None = None,
    ) -> None:
        super().__init__()
        env = os.environ
        raw_tags = env.get("MLFLOW_TAGS", tags)
        nested = env.get("MLFLOW_NESTED_RUN")
        self.experiment_name = env.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.logging_dir = None if logging_dir is None else os.fspath(logging_dir)
        self.run_id = env.get("MLFLOW_RUN_ID", run_id)
        parsed = json.loads(raw_tags) if isinstance(raw_tags, str) else raw_tags
        self.tags: dict[str, Any] | None = None if parsed is None else dict(parsed)
        self.nested_run = nested_run if nested is None else _true(nested)
        self.run_name = run_name
        self.description = description
        self.tracking_uri = tracking_uri
        self.active_run: Any = None
        self._dropped: set[str] = set()

    @classmethod
    def is_available(cls) -> bool:
        """Whether the ``mlflow`` package (``mlflow`` or ``mlflow-skinny``) is installed."""
        return package_installed("mlflow")

    @property
    def tracker(self) -> Any:
        """The ``mlflow.ActiveRun`` (``None`` before :meth:`start` and after :meth:`finish`)."""
        return self.active_run

    @property
    def endpoint(self) -> str | None:
        """The tracking URI the run goes to: ``tracking_uri``, else ``MLFLOW_TRACKING_URI``
        (``None``: MLflow's default local ``mlruns`` folder)."""
        return self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None

    def start(self) -> None:
        """Find or create the experiment, then start (or resume) the run.

        Raises:
            ModuleNotFoundError: ``mlflow`` is not installed (the message names
                ``pip install 'kwplug[mlflow]'``).
        """
        mlflow = _mlflow()
        if self.tracking_uri is not None:
            mlflow.set_tracking_uri(self.tracking_uri)
        experiment_id = None
        if self.experiment_name is not None:
            experiment = mlflow.get_experiment_by_name(self.experiment_name)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else mlflow.create_experiment(
                    self.experiment_name, artifact_location=self.logging_dir, tags=self.tags
                )
            )
        self.active_run = mlflow.start_run(
            run_id=self.run_id,
            experiment_id=experiment_id,
            run_name=self.run_name,
            nested=self.nested_run,
            tags=self.tags,
            description=self.description,
        )

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Log ``values`` as the run's parameters (MLflow stores each as a string; nested
        dicts as their ``str()``), in batches of 100.

        Warns:
            kwplug.errors.TrackerConfigWarning: values longer than MLflow's 6000 characters
                were left out (the message and ``keys`` name them).
        """
        mlflow = _mlflow()
        params: dict[str, Any] = {}
        too_long: list[str] = []
        for key, value in values.items():
            value = plain_value(value)
            if len(str(value)) > _MAX_PARAM_LENGTH:
                too_long.append(str(key))
            else:
                params[str(key)] = value
        if too_long:
            warnings.warn(
                TrackerConfigWarning(
                    f"mlflow: configuration key(s) {', '.join(map(repr, too_long))} were not "
                    f"logged: MLflow parameters hold at most {_MAX_PARAM_LENGTH} characters",
                    tracker=self.name,
                    keys=tuple(too_long),
                ),
                stacklevel=2,
            )
        items = list(params.items())
        for first in range(0, len(items), _PARAMS_PER_BATCH):
            mlflow.log_params(dict(items[first : first + _PARAMS_PER_BATCH]))

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log the numbers in ``values`` as metrics at ``step`` (``mlflow.log_metrics``).

        MLflow metrics are numbers: other values (strings, dicts) are left out, with one
        ``UserWarning`` per key and tracker (as Accelerate does).

        Args:
            values: metric name -> number (``int``, ``float``, one-element tensor).
            step: the step, or ``None`` (MLflow records 0).
            kwargs: passed to ``mlflow.log_metrics`` (e.g. ``timestamp``), from
                ``log_kwargs["mlflow"]``.
        """
        mlflow = _mlflow()
        metrics: dict[str, float] = {}
        for key, value in values.items():
            value = plain_value(value)
            if isinstance(value, numbers.Real):
                metrics[key] = float(value)
            elif key not in self._dropped:
                self._dropped.add(key)
                warnings.warn(
                    f"mlflow: {key!r} is a {type(value).__name__}, not a number; MLflow "
                    "metrics are numbers, so it was not logged",
                    UserWarning,
                    stacklevel=2,
                )
        if metrics:
            mlflow.log_metrics(metrics, step=step, **kwargs)

    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """Save a matplotlib or plotly ``figure`` as the run artifact ``artifact_file``
        (``mlflow.log_figure``; ``save_kwargs`` go to it)."""
        mlflow = _mlflow()
        mlflow.log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """Copy the file ``local_path`` into the run's artifacts (under ``artifact_path``)."""
        mlflow = _mlflow()
        mlflow.log_artifact(local_path=local_path, artifact_path=artifact_path)

    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        """Copy the folder ``local_dir``'s files into the run's artifacts."""
        mlflow = _mlflow()
        mlflow.log_artifacts(local_dir=local_dir, artifact_path=artifact_path)

    def finish(self) -> None:
        """End the run (``mlflow.end_run()``)."""
        if self.active_run is not None:
            mlflow = _mlflow()
            mlflow.end_run()
            self.active_run = None


def _mlflow() -> Any:
    return import_tracker_package("mlflow", MLflowTracker.name, _EXTRA)


def _true(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "y", "on")


@hookimpl
def trackers() -> Mapping[str, TrackerFactory]:
    """The ``"mlflow"`` tracker."""
    return {MLflowTracker.name: MLflowTracker}

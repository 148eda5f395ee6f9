"""The Aim tracker (``log_with="aim"``), a plugin of its own.

This module is a plugin object (entry point ``aim`` of the ``kwplug.handlers`` group) whose
``trackers`` hook gives ``"aim"``: :class:`AimTracker`. It needs the ``kwplug[aim]`` extra;
without it the plugin still loads (``aim`` is imported only when a run starts),
``log_with="all"`` leaves it out, and ``log_with="aim"`` fails at ``init_trackers`` with a
message naming the extra.

Runs go to the Aim repository ``<logging_dir>/.aim`` (created when missing), on this machine:
no account, no network. ``aim up --repo <logging_dir>`` shows them. Aim 3.27 and later index
a run for reading in that server (or in ``aim storage --repo <logging_dir> reindex``), not
when it closes: ``aim.Repo(<logging_dir>).iter_runs()`` sees a finished run only once one of
the two has indexed it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

from kwplug.hookspecs import hookimpl
from kwplug.plugins._client_tracker import ClientTracker
from kwplug.tracking import TrackerFactory, plain_value

__all__ = ["AimTracker", "trackers"]


class AimTracker(ClientTracker):
    """Logs to an Aim run (``aim.Run``), as Accelerate's ``AimTracker``.

    The run is created in the repository at ``logging_dir`` and named after the project given
    to ``init_trackers``; everything in ``init_kwargs["aim"]`` goes to ``aim.Run``
    (``experiment``, ``run_hash`` to resume, ``system_tracking_interval``,
    ``capture_terminal_logs``...).
    The configuration is the run's ``"hparams"`` (nested dicts stay nested), each value of
    :meth:`log` one ``run.track`` at the step.

    Args:
        run_name: the project name given to ``init_trackers`` (the run's ``name``).
        logging_dir: ``str`` or ``os.PathLike``, the Aim repository's folder (the
            Accelerator's ``logging_dir``; default ``"."``).
        kwargs: passed to ``aim.Run``.
    """

    name: ClassVar[str] = "aim"
    requires_logging_directory: ClassVar[bool] = True
    package: ClassVar[str] = "aim"
    requirement: ClassVar[str | None] = "kwplug[aim]"
    close_method: ClassVar[str] = "close"  # ends the run and stops its background threads

    def __init__(
        self, run_name: str, logging_dir: str | os.PathLike[str] = ".", **kwargs: Any
    ) -> None:
        super().__init__(run_name, **kwargs)
        self.aim_repo_path = os.fspath(logging_dir)

    def start(self) -> None:
        """Start the run: ``aim.Run(repo=logging_dir, **kwargs)``, named ``run_name``.

        Raises:
            ModuleNotFoundError: ``aim`` is not installed (the message names
                ``pip install 'kwplug[aim]'``).
        """
        aim = self.client()
        self.writer = aim.Run(repo=self.aim_repo_path, **self.init_kwargs)
        self.writer.name = self.run_name

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Set the run's ``"hparams"`` to ``values`` (one-element tensors as numbers)."""
        self.writer["hparams"] = self.plain(values)

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``run.track(value, name=key, step=step, **kwargs)`` for each value.

        Args:
            values: metric name -> number (one-element tensors included) or any Aim object
                (``aim.Image``, ``aim.Text``, ``aim.Distribution``...).
            step: the step, or ``None`` (Aim counts on from the sequence's last step).
            kwargs: passed to ``run.track`` (``epoch``, ``context``), from ``log_kwargs["aim"]``.
        """
        for key, value in values.items():
            self.writer.track(plain_value(value), name=key, step=step, **kwargs)

    def log_images(
        self,
        values: Mapping[str, Any],
        step: int | None = None,
        kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Log one image per key as an ``aim.Image`` (Accelerate's signature).

        Args:
            values: key -> a NumPy array or PIL image, or an ``(image, caption)`` tuple.
            step: the step, or ``None``.
            kwargs: ``{"aim_image": {...}}`` for ``aim.Image``, ``{"track": {...}}`` for
                ``run.track``; default ``None``.
        """
        aim = self.client()
        image_kwargs = dict((kwargs or {}).get("aim_image", {}))
        track_kwargs = dict((kwargs or {}).get("track", {}))
        for key, value in values.items():
            image, caption = value if isinstance(value, tuple) else (value, "")
            tracked = aim.Image(image, caption=caption, **image_kwargs)
            self.writer.track(tracked, name=key, step=step, **track_kwargs)


@hookimpl
def trackers() -> Mapping[str, TrackerFactory]:
    """The ``"aim"`` tracker."""
    return {AimTracker.name: AimTracker}

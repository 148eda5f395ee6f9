"""The Weights & Biases tracker (``log_with="wandb"``), a plugin of its own.

This module is a plugin object (entry point ``wandb`` of the ``kwplug.handlers`` group) whose
``trackers`` hook gives ``"wandb"``: :class:`WandBTracker`. It needs the ``kwplug[wandb]``
extra; without it the plugin still loads (``wandb`` is imported only when a run starts),
``log_with="all"`` leaves it out, and ``log_with="wandb"`` fails at ``init_trackers`` with a
message naming the extra.

Offline runs (no account, no network): set ``WANDB_MODE=offline`` (and ``WANDB_DIR`` for where
the ``wandb/offline-run-*`` folders go), or pass ``init_kwargs={"wandb": {"mode": "offline"}}``;
``wandb sync <run folder>`` uploads one later.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from kwplug.hookspecs import hookimpl
from kwplug.plugins._client_tracker import ClientTracker
from kwplug.tracking import TrackerFactory

__all__ = ["WandBTracker", "trackers"]


class WandBTracker(ClientTracker):
    """Logs to a Weights & Biases run (``wandb.init``), as Accelerate's ``WandBTracker``.

    The project is the name given to ``init_trackers``; everything in
    ``init_kwargs["wandb"]`` goes to ``wandb.init`` (``entity``, ``name``, ``tags``, ``mode``,
    ``dir``, ``group``...). The configuration goes to ``run.config`` (nested dicts stay
    nested), each :meth:`log` to ``run.log`` at the given step.

    Args:
        run_name: the project name given to ``init_trackers`` (``wandb.init(project=...)``).
        kwargs: passed to ``wandb.init``.
    """

    name: ClassVar[str] = "wandb"
    package: ClassVar[str] = "wandb"
    requirement: ClassVar[str | None] = "kwplug[wandb]"
    close_method: ClassVar[str] = "finish"  # run.finish(): flushes and, online, uploads

    @property
    def run(self) -> Any:
        """The ``wandb`` run (``wandb.Run``, Accelerate's attribute; ``None`` before
        :meth:`start`): :attr:`tracker`."""
        return self.writer

    def start(self) -> None:
        """Start the run: ``wandb.init(project=run_name, **kwargs)``.

        Raises:
            ModuleNotFoundError: ``wandb`` is not installed (the message names
                ``pip install 'kwplug[wandb]'``).
        """
        wandb = self.client()
        self.writer = wandb.init(project=self.run_name, **self.init_kwargs)

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Add ``values`` to the run's config (``run.config.update``, values may change).

        Args:
            values: the configuration; nested dicts, lists and numbers are stored as given,
                one-element tensors as numbers.
        """
        self.run.config.update(self.plain(values), allow_val_change=True)

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``run.log(values, step=step, **kwargs)``, one-element tensors as numbers.

        W&B keeps steps increasing: values logged at a step lower than one already logged are
        dropped by ``wandb`` with a warning.

        Args:
            values: metric name -> number, string, dict, or any ``wandb`` data type.
            step: the step, or ``None`` for wandb's own counter.
            kwargs: passed to ``run.log`` (e.g. ``commit``), from ``log_kwargs["wandb"]``.
        """
        self.run.log(self.plain(values), step=step, **kwargs)

    def log_images(
        self, values: Mapping[str, Sequence[Any]], step: int | None = None, **kwargs: Any
    ) -> None:
        """Log lists of images: each ``values[key]`` (NumPy arrays, PIL images or tensors)
        becomes a list of ``wandb.Image`` under ``key``.

        Args:
            values: key -> a sequence of images.
            step: the step, or ``None``.
            kwargs: passed to ``run.log``.
        """
        wandb = self.client()
        images = {key: [wandb.Image(image) for image in items] for key, items in values.items()}
        self.run.log(images, step=step, **kwargs)

    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Log a ``wandb.Table`` under ``table_name``, from ``columns`` and ``data`` (rows) or
        from a pandas ``dataframe``.

        Args:
            table_name: the key of the table in the run.
            columns: column names, default ``None``.
            data: the rows, default ``None``.
            dataframe: a ``pandas.DataFrame`` instead of ``columns``/``data``, default ``None``.
            step: the step, or ``None``.
            kwargs: passed to ``run.log``.
        """
        wandb = self.client()
        table = wandb.Table(columns=columns, data=data, dataframe=dataframe)
        self.run.log({table_name: table}, step=step, **kwargs)


@hookimpl
def trackers() -> Mapping[str, TrackerFactory]:
    """The ``"wandb"`` tracker."""
    return {WandBTracker.name: WandBTracker}

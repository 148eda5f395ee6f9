"""kwplug's built-in experiment trackers, contributed through the ``trackers`` hook.

This module is itself a plugin object (entry point ``trackers`` of the ``kwplug.handlers``
group), like :mod:`kwplug.plugins.ddp_comm_hooks`: its module-level :func:`trackers`
implementation gives ``"tensorboard"`` (:class:`TensorBoardTracker`, needs the
``kwplug[tensorboard]`` extra) and ``"jsonl"`` (:class:`JSONLinesTracker`, no dependency).
"""

from __future__ import annotations

import itertools
import json
import numbers
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, ClassVar

import torch

from kwplug.errors import KwplugWarning
from kwplug.hookspecs import hookimpl
from kwplug.tracking import GeneralTracker, TrackerFactory, flatten_config

__all__ = ["JSONLinesTracker", "TensorBoardTracker", "trackers"]


class TensorBoardTracker(GeneralTracker):
    """Logs to TensorBoard through ``torch.utils.tensorboard.SummaryWriter``.

    Event files go to ``<logging_dir>/<run_name>`` (as Accelerate's tracker). Numbers (and
    0-d tensors) are logged with ``add_scalar``, strings with ``add_text``, and a dict of
    numbers with ``add_scalars``; the configuration with ``add_hparams`` and, as Accelerate
    does, to ``<logging_dir>/<run_name>/<time.time()>/hparams.yml``.

    Args:
        run_name: the project name given to ``init_trackers``.
        logging_dir: ``str`` or ``os.PathLike``, the Accelerator's ``logging_dir``.
        kwargs: passed to ``SummaryWriter`` (e.g. ``flush_secs``), from
            ``init_kwargs["tensorboard"]``.

    Raises:
        ModuleNotFoundError: (from :meth:`start`) ``tensorboard`` is not installed; the
            message names the ``kwplug[tensorboard]`` extra.
    """

    name: ClassVar[str] = "tensorboard"
    requires_logging_directory: ClassVar[bool] = True
    requirement: ClassVar[str | None] = "kwplug[tensorboard]"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir = os.path.join(logging_dir, run_name)
        self.init_kwargs = kwargs
        self.writer: Any = None

    @classmethod
    def is_available(cls) -> bool:
        """Whether the ``tensorboard`` package (which ``SummaryWriter`` needs) is installed."""
        import importlib.util

        return importlib.util.find_spec("tensorboard") is not None

    @property
    def tracker(self) -> Any:
        """The ``SummaryWriter`` (``None`` before :meth:`start`)."""
        return self.writer

    def start(self) -> None:
        """Create the ``SummaryWriter``.

        Raises:
            ModuleNotFoundError: ``tensorboard`` or ``pyyaml`` is not installed (names the
                extra).
        """
        try:
            import yaml  # noqa: F401  (checked here: store_init_configuration needs it)
            from torch.utils.tensorboard import SummaryWriter
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                f"log_with='tensorboard' needs the {exc.name} package: "
                "pip install 'kwplug[tensorboard]'"
            ) from exc
        self.writer = SummaryWriter(self.logging_dir, **self.init_kwargs)

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Log ``values`` as hyperparameters and write them to ``hparams.yml``.

        TensorBoard's hparams (``SummaryWriter.add_hparams``, in the run's
        ``<time.time()>`` sub-folder) hold only numbers, strings and booleans: values that
        are lists, tuples, nested dicts or other objects are flattened or stringified by
        :func:`kwplug.tracking.flatten_config`, with a warning naming the keys (Accelerate
        and torch raise ``ValueError`` instead). ``hparams.yml`` in the same folder keeps
        ``values`` as given (``yaml.safe_dump``; tuples as lists, one-element tensors and
        NumPy scalars as numbers, other objects as strings), Accelerate's file for the
        configurations Accelerate accepts.

        Warns:
            kwplug.errors.TrackerConfigWarning: some values were flattened or stringified.
        """
        import yaml

        stamp = str(time.time())
        hparams = flatten_config(values, self.name)
        # One folder for the hparams events and the YAML file (Accelerate makes two, from
        # two time stamps).
        self.writer.add_hparams(hparams, metric_dict={}, run_name=stamp)
        self.writer.flush()
        folder = Path(self.logging_dir) / stamp
        folder.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(_yaml_ready(values), default_flow_style=False, sort_keys=True)
        (folder / "hparams.yml").write_text(text, encoding="utf-8")

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log each value by type: numbers as scalars, ``str`` as text, dicts of numbers as
        grouped scalars; ``kwargs`` go to the ``add_*`` call."""
        for key, value in values.items():
            value = _plain(value)
            if isinstance(value, numbers.Number):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, Mapping):
                scalars = {k: _plain(v) for k, v in value.items()}
                self.writer.add_scalars(key, scalars, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        """Close the writer (flushes the event file)."""
        if self.writer is not None:
            self.writer.close()


class JSONLinesTracker(GeneralTracker):
    """Appends one JSON object per :meth:`log` call to ``<logging_dir>/<run_name>/log.jsonl``.

    Each line is ``{"step": step, **values}`` (``step`` is ``null`` when not given), written
    and flushed at once, so the file can be followed while training runs. 0-d tensors and
    NumPy scalars are written as numbers. The configuration goes to ``config.json`` next to it.

    A run folder whose log file exists belongs to another run (a concurrent one, or an earlier
    one): a new run never writes into it. It logs into ``<run_name>-1`` (``-2``...), the first
    whose log file it could create (``O_EXCL``, so two runs starting at once never share one),
    with a :class:`~kwplug.errors.KwplugWarning` naming both folders; ``append=True`` continues
    the existing log instead (a resumed run).

    Args:
        run_name: the project name given to ``init_trackers``.
        logging_dir: ``str`` or ``os.PathLike``, the Accelerator's ``logging_dir``.
        filename: the log file's name, default ``"log.jsonl"`` (``init_kwargs["jsonl"]``).
        append: ``bool``, default ``False``: continue an existing log file of ``run_name``
            (``init_kwargs={"jsonl": {"append": True}}``) instead of starting a new folder.

    Raises:
        TypeError: ``append`` is not a ``bool``.
    """

    name: ClassVar[str] = "jsonl"
    requires_logging_directory: ClassVar[bool] = True

    def __init__(
        self,
        run_name: str,
        logging_dir: str | os.PathLike[str],
        filename: str = "log.jsonl",
        append: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(append, bool):
            raise TypeError(f"jsonl tracker: append must be a bool, got {type(append).__name__}")
        self.run_name = run_name
        self.append = append
        self.directory = Path(logging_dir) / run_name
        self.path = self.directory / filename
        self.file: IO[str] | None = None

    @property
    def tracker(self) -> IO[str] | None:
        """The open log file (``None`` before :meth:`start` and after :meth:`finish`)."""
        return self.file

    def start(self) -> None:
        """Create the run folder and its log file (see the class docstring for a name in use).

        Raises:
            OSError: the folder or the file cannot be created.
        """
        if self.append:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.file = self.path.open("a", encoding="utf-8")
            return
        first, name = self.directory, self.path.name
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        for suffix in itertools.count():
            folder = first if suffix == 0 else first.with_name(f"{first.name}-{suffix}")
            folder.mkdir(parents=True, exist_ok=True)
            try:  # O_EXCL: the run that creates the log file owns the folder
                fd = os.open(folder / name, flags, 0o666)
            except FileExistsError:
                continue
            break
        self.directory, self.path = folder, folder / name
        self.file = os.fdopen(fd, "a", encoding="utf-8")
        if folder != first:
            warnings.warn(
                f"jsonl tracker: {first / name} belongs to another run of {self.run_name!r}; "
                f"this run logs into {folder} (init_kwargs={{'jsonl': {{'append': True}}}} "
                "continues that log instead)",
                KwplugWarning,
                stacklevel=2,
            )

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Write ``values`` to ``config.json`` in the run folder."""
        text = json.dumps(dict(values), default=_plain, indent=2, sort_keys=True)
        (self.directory / "config.json").write_text(text + "\n", encoding="utf-8")

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Write ``{"step": step, **values}`` as one line and flush it.

        Raises:
            RuntimeError: the tracker was not started, or is finished.
            TypeError: a value is not JSON-serialisable.
        """
        if self.file is None:
            raise RuntimeError("JSONLinesTracker.log called before start() or after finish()")
        self.file.write(json.dumps({"step": step, **values}, default=_plain) + "\n")
        self.file.flush()

    def finish(self) -> None:
        """Close the log file."""
        if self.file is not None:
            self.file.close()
            self.file = None


def _plain(value: Any) -> Any:
    # 0-d tensors and NumPy scalars (both have .item()) become Python numbers.
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, (str, bytes, Mapping)):
        return item()
    if isinstance(value, (str, numbers.Number, Mapping, list, tuple)) or value is None:
        return value
    raise TypeError(f"cannot log a value of type {type(value).__name__}")


def _yaml_ready(value: Any) -> Any:
    # What yaml.safe_dump writes plainly: mappings and lists of bool/int/float/str/None.
    if isinstance(value, Mapping):
        return {str(k): _yaml_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_yaml_ready(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        plain = _plain(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: .item() of a larger tensor
        return str(value)
    return str(value) if plain is value else _yaml_ready(plain)


@hookimpl
def trackers() -> Mapping[str, TrackerFactory]:
    """kwplug's built-in trackers: ``"tensorboard"`` and ``"jsonl"``."""
    return {TensorBoardTracker.name: TensorBoardTracker, JSONLinesTracker.name: JSONLinesTracker}

"""Accelerate's ``accelerate.tracking`` names on kwplug (issue 28 item 3): the tracker classes,
``LOGGER_TYPE_TO_CLASS`` and ``register_tracker_class``, as Accelerate's tests/test_tracking.py
imports and uses them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

import kwplug
import kwplug.tracking as tracking
from kwplug.plugins.trackers import TensorBoardTracker
from kwplug.tracking import GeneralTracker


class Recorder(GeneralTracker):
    name: ClassVar[str] = "recorder"
    requires_logging_directory: ClassVar[bool] = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name, self.kwargs = run_name, kwargs
        self.config: dict[str, Any] = {}
        self.values: dict[str, Any] = {}

    @property
    def tracker(self) -> Any:
        return self

    def store_init_configuration(self, values: Any) -> None:
        self.config.update(values)

    def log(self, values: Any, step: int | None = None, **kwargs: Any) -> None:
        self.values.update(values)


class DirRecorder(Recorder):
    name: ClassVar[str] = "dir_recorder"
    requires_logging_directory: ClassVar[bool] = True

    def __init__(self, run_name: str, logging_dir: str, **kwargs: Any) -> None:
        super().__init__(run_name, **kwargs)
        self.logging_dir = logging_dir


@pytest.fixture
def registry() -> Iterator[dict[str, Any]]:
    from kwplug.tracking import LOGGER_TYPE_TO_CLASS

    snapshot = dict(LOGGER_TYPE_TO_CLASS)
    yield LOGGER_TYPE_TO_CLASS
    LOGGER_TYPE_TO_CLASS.clear()
    LOGGER_TYPE_TO_CLASS.update(snapshot)


def test_accelerates_names_import_lazily() -> None:
    code = (
        "import sys, kwplug.tracking as t\n"
        "assert 'kwplug.plugins.trackers' not in sys.modules\n"
        "from kwplug.tracking import (LOGGER_TYPE_TO_CLASS, AimTracker, ClearMLTracker,\n"
        "    CometMLTracker, DVCLiveTracker, MLflowTracker, SwanLabTracker, TensorBoardTracker,\n"
        "    TrackioTracker, WandBTracker, register_tracker_class)\n"
        "print(sorted(LOGGER_TYPE_TO_CLASS))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.split() == ["['aim',", "'comet_ml',", "'mlflow',", "'tensorboard',", "'wandb']"]


def test_builtin_entries_are_the_plugins_classes(registry: dict[str, Any]) -> None:
    assert registry["tensorboard"] is TensorBoardTracker is tracking.TensorBoardTracker
    from kwplug.plugins.wandb_tracker import WandBTracker

    assert registry["wandb"] is WandBTracker


def test_a_tracker_kwplug_lacks_imports_and_refuses_to_build() -> None:
    from kwplug.tracking import ClearMLTracker

    assert issubclass(ClearMLTracker, GeneralTracker)
    assert ClearMLTracker.is_available() is False
    with pytest.raises(NotImplementedError, match="accelerate.tracking.ClearMLTracker"):
        ClearMLTracker("run")


def test_registered_tracker_is_built_by_name(registry: dict[str, Any]) -> None:
    tracking.register_tracker_class(Recorder)
    assert registry["recorder"] is Recorder
    accelerator = kwplug.Accelerator(log_with="recorder")
    accelerator.init_trackers("project", {"lr": 0.1})
    accelerator.log({"loss": 0.5}, step=0)
    tracker = accelerator.get_tracker("recorder", unwrap=True)
    accelerator.end_training()
    assert isinstance(tracker, Recorder)
    assert (tracker.run_name, tracker.config, tracker.values) == (
        "project",
        {"lr": 0.1},
        {"loss": 0.5},
    )


def test_registered_tracker_needing_a_directory(registry: dict[str, Any], tmp_path: Path) -> None:
    tracking.register_tracker_class(DirRecorder)
    with pytest.raises(ValueError, match="Logging with `dir_recorder` requires a `logging_dir`"):
        kwplug.Accelerator(log_with="dir_recorder")
    accelerator = kwplug.Accelerator(log_with="dir_recorder", project_dir=str(tmp_path))
    accelerator.init_trackers("dir_project")
    tracker = accelerator.get_tracker("dir_recorder", unwrap=True)
    accelerator.end_training()
    assert isinstance(tracker, DirRecorder)
    assert (tracker.run_name, tracker.logging_dir) == ("dir_project", str(tmp_path))


def test_register_refuses_what_accelerate_refuses(registry: dict[str, Any]) -> None:
    class Nameless(GeneralTracker):
        requires_logging_directory = False

    class NoFlag(GeneralTracker):
        name = "no_flag"

    for bad in (dict, Nameless, NoFlag):
        with pytest.raises(ValueError):
            tracking.register_tracker_class(bad)  # type: ignore[arg-type]
    tracking.register_tracker_class(Recorder)
    with pytest.warns(UserWarning, match="recorder"):
        tracking.register_tracker_class(Recorder)


def test_only_registered_entries_reach_the_accelerator(registry: dict[str, Any]) -> None:
    # The dict holds the plugins' classes, but those still come through the hook only (so a
    # blocked plugin stays out); what register_tracker_class added is added to the hook's.
    assert tracking._registered() == {}
    tracking.register_tracker_class(Recorder)
    assert tracking._registered() == {"recorder": Recorder}

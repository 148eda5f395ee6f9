"""The aim tracker plugin: a local Aim repository read back through ``aim.Repo`` (hparams,
metrics by step, images), ``log_with="all"``, the missing-package message, and a run that
matches Accelerate's ``AimTracker``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aim_records import read_runs

import kwplug
from kwplug.plugins.aim_tracker import AimTracker

pytest.importorskip("aim")

#: No resource-tracking thread: the runs here last a second.
QUIET = {"aim": {"system_tracking_interval": None}}


def test_repo_holds_hparams_and_metrics_by_step(
    tmp_path: Path, train: Callable[..., list[float]]
) -> None:
    np = pytest.importorskip("numpy")
    accelerator = kwplug.Accelerator(cpu=True, log_with="aim", project_dir=tmp_path)
    config = {"lr": 0.1, "optim": {"name": "sgd"}, "layers": [4, 1]}
    init_kwargs = {"aim": {**QUIET["aim"], "experiment": "exp"}}
    accelerator.init_trackers("kwplug-test", config=config, init_kwargs=init_kwargs)
    run = accelerator.get_tracker("aim", unwrap=True)
    assert run.name == "kwplug-test" and (tmp_path / ".aim").is_dir()  # the logging_dir
    losses = train(accelerator, more=lambda step: {"acc": step / 4})
    tracker = accelerator.get_tracker("aim")
    assert isinstance(tracker, AimTracker)
    tracker.log_images({"samples": (np.zeros((8, 6, 3), dtype=np.uint8), "zeros")}, step=3)
    accelerator.end_training()
    assert tracker.tracker is None

    (logged,) = read_runs(tmp_path)
    assert logged["name"] == "kwplug-test" and logged["experiment"] == "exp"
    assert logged["hparams"] == config
    steps, values = logged["metrics"]["loss"]
    assert steps == [1, 2, 3] and values == pytest.approx(losses)  # 0-d tensors as numbers
    assert logged["metrics"]["acc"] == ([1, 2, 3], [0.25, 0.5, 0.75])
    assert logged["images"] == {"samples": ([3], [("zeros", (6, 8))])}


def test_missing_aim_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "aim", None)
    accelerator = kwplug.Accelerator(cpu=True, log_with="aim", project_dir=tmp_path)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'kwplug\[aim\]'"):
        accelerator.init_trackers("p")


def test_all_includes_aim_when_installed(tmp_path: Path) -> None:
    accelerator = kwplug.Accelerator(cpu=True, log_with="all", project_dir=tmp_path)
    assert "aim" in accelerator._trackers.selected and AimTracker.is_available()
    with pytest.raises(ValueError, match="'aim' writes files and needs a logging directory"):
        kwplug.Accelerator(cpu=True, log_with="aim")


def _log_a_run(accelerator: Any, experiment: str) -> None:
    init_kwargs = {"aim": {**QUIET["aim"], "experiment": experiment}}
    accelerator.init_trackers("parity", {"lr": 2e-5, "epochs": 2}, init_kwargs=init_kwargs)
    for epoch in range(2):
        values = {"accuracy": 0.75 + epoch / 10, "train_loss": 0.5 / (epoch + 1), "epoch": epoch}
        accelerator.log(values, step=epoch)
    accelerator.end_training()


def test_run_matches_accelerate(tmp_path: Path) -> None:
    import accelerate

    # One repository for both (a new one costs Aim a database migration of seconds).
    try:
        _log_a_run(accelerate.Accelerator(cpu=True, log_with="aim", project_dir=tmp_path), "a")
    finally:
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    _log_a_run(kwplug.Accelerator(cpu=True, log_with="aim", project_dir=tmp_path), "k")
    runs = {run.pop("experiment"): run for run in read_runs(tmp_path)}
    assert runs["k"] == runs["a"] and set(runs["k"]["metrics"]) == {
        "accuracy",
        "train_loss",
        "epoch",
    }

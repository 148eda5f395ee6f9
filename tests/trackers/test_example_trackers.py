"""``examples/train_digits.py --log-with wandb|mlflow|comet_ml|aim`` offline, with the
example's defaults (no tracking variables set): the curves are read back through each
tracker's reader."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from python import python
from wandb_records import read_run, run_folder

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"
VARIABLES = (
    "WANDB_MODE",
    "WANDB_DIR",
    "WANDB_API_KEY",
    "MLFLOW_TRACKING_URI",
    "COMET_API_KEY",
    "COMET_START_ONLINE",
    "COMET_OFFLINE_DIRECTORY",
)


def run_example(tracker: str, project_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    command = [str(EXAMPLE), "--cpu", "--epochs", "2", "--no-progress"]
    command += ["--log-with", tracker, "--project-dir", str(project_dir)]
    python(*command, env=env, check=True, timeout=240)


def test_example_logs_to_an_offline_wandb_run(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    run_example("wandb", tmp_path)
    logged = read_run(run_folder(tmp_path))
    assert logged["project"] == "train_digits"
    assert {k: logged["config"][k] for k in ("lr", "epochs")} == {"lr": 0.01, "epochs": 2}
    rows = [row for row in logged["history"] if "train_loss" in row]
    assert [row["_step"] for row in rows] == [1, 2]
    assert rows[1]["train_loss"] < rows[0]["train_loss"]
    assert all(0 <= row["test_accuracy"] <= 1 for row in rows)


def test_example_logs_to_a_local_mlflow_store(tmp_path: Path) -> None:
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    run_example("mlflow", tmp_path)
    uri = (tmp_path / "mlruns").as_uri()
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("train_digits")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["epochs"] == "2"
    losses = client.get_metric_history(run.info.run_id, "train_loss")
    assert [m.step for m in losses] == [1, 2] and losses[1].value < losses[0].value
    assert [m.step for m in client.get_metric_history(run.info.run_id, "test_accuracy")] == [1, 2]
    assert mlflow.get_tracking_uri() != uri  # the example's setting stayed in its process


def test_example_logs_to_an_offline_comet_archive(tmp_path: Path) -> None:
    pytest.importorskip("comet_ml")
    from test_comet_ml import read_archive

    run_example("comet_ml", tmp_path)
    logged = read_archive(tmp_path / "comet")
    assert logged["project"] == "train_digits" and logged["params"]["lr"] == 0.01
    losses = logged["metrics"]["train_loss"]
    assert [s for s, _ in losses] == [1, 2] and losses[1][1] < losses[0][1]


def test_example_logs_to_a_local_aim_repository(tmp_path: Path) -> None:
    pytest.importorskip("aim")
    from aim_records import read_runs

    run_example("aim", tmp_path)
    (logged,) = read_runs(tmp_path)
    assert logged["name"] == "train_digits" and logged["hparams"]["epochs"] == 2
    steps, losses = logged["metrics"]["train_loss"]
    assert steps == [1, 2] and losses[1] < losses[0]
    assert logged["metrics"]["test_accuracy"][0] == [1, 2]

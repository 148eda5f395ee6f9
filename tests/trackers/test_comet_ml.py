"""The comet_ml tracker plugin: an offline experiment's archive read back (parameters, metrics
by step, other values), the missing-package message, and the same messages as Accelerate's."""

from __future__ import annotations

import json
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import kwplug

pytest.importorskip("comet_ml")


def read_archive(folder: Path) -> dict[str, Any]:
    """The one offline experiment in ``folder``: its project, parameters, user metrics by
    name as (step, value) and "other" values (Comet's own messages left out)."""
    (path,) = folder.glob("*.zip")
    with zipfile.ZipFile(path) as archive:
        experiment = json.loads(archive.read("experiment.json"))
        messages = [json.loads(line) for line in archive.read("messages.json").splitlines()]
    params, metrics, others = {}, {}, {}
    for message in messages:
        payload = message["payload"]
        param = payload.get("param", {})
        manual = param.get("source") == "manual" and param.get("paramName") != "curr_step"
        if message["type"] == "parameter_msg" and manual:
            params[param["paramName"]] = param["paramValue"]  # (curr_step: set_step's)
        elif message["type"] == "metric_msg":
            metric = payload["metric"]
            if not metric["metricName"].startswith("sys.") and metric["metricName"] != (
                "process duration"
            ):
                metrics.setdefault(metric["metricName"], []).append(
                    (metric["step"], metric["metricValue"])
                )
        elif message["type"] == "log_other" and payload["key"] not in (
            "offline_experiment",
            "hasNestedParams",
        ):
            others[payload["key"]] = payload["value"]
    return {
        "project": experiment["project_name"],
        "params": params,
        "metrics": metrics,
        "others": others,
    }


def test_offline_experiment_holds_params_and_metrics_by_step(
    offline_dir: Path, train: Callable[..., list[float]]
) -> None:
    accelerator = kwplug.Accelerator(cpu=True, log_with="comet_ml")
    accelerator.init_trackers("kwplug-test", config={"lr": 0.1, "optim": {"name": "sgd"}})
    losses = train(accelerator, more=lambda step: {"note": f"step {step}"})
    accelerator.log({"eval": {"acc": 0.5}}, step=3)
    accelerator.end_training()

    logged = read_archive(offline_dir)
    assert logged["project"] == "kwplug-test"
    assert logged["params"] == {"lr": 0.1, "optim|name": "sgd"}
    assert [s for s, _ in logged["metrics"]["loss"]] == [1, 2, 3]
    assert [v for _, v in logged["metrics"]["loss"]] == pytest.approx(losses)
    assert logged["metrics"]["acc"] == [(3, 0.5)] and logged["others"]["note"] == "step 3"


def test_missing_comet_ml_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "comet_ml", None)
    accelerator = kwplug.Accelerator(cpu=True, log_with="comet_ml")
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'kwplug\[comet_ml\]'"):
        accelerator.init_trackers("p")


def test_messages_match_accelerate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import accelerate

    def log_a_run(accelerator: Any, folder: Path) -> dict[str, Any]:
        folder.mkdir()
        monkeypatch.setenv("COMET_START_ONLINE", "false")
        monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(folder))
        accelerator.init_trackers("parity", {"lr": 2e-5, "epochs": 2, "name": "x"})
        for epoch in range(2):
            values = {"accuracy": 0.75 + epoch / 10, "train_loss": 0.5 / (epoch + 1)}
            accelerator.log({**values, "epoch": epoch, "note": "n"}, step=epoch)
        accelerator.end_training()
        return read_archive(folder)

    try:
        theirs = log_a_run(accelerate.Accelerator(cpu=True, log_with="comet_ml"), tmp_path / "a")
    finally:
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    ours = log_a_run(kwplug.Accelerator(cpu=True, log_with="comet_ml"), tmp_path / "k")
    assert ours == theirs and set(ours["metrics"]) == {"accuracy", "train_loss", "epoch"}

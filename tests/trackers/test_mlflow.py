"""The mlflow tracker plugin: a local ``file:`` store read back with MLflow's client (params,
metrics by step, tags), the environment variables, dropped values, the missing package."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import kwplug
from kwplug.errors import TrackerConfigWarning
from kwplug.plugins.mlflow_tracker import MLflowTracker

mlflow = pytest.importorskip("mlflow")


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.x: file stores are opt-in
    for name in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "MLFLOW_TAGS", "MLFLOW_NESTED_RUN"):
        monkeypatch.delenv(name, raising=False)
    mlflow.set_tracking_uri(uri)
    return uri


def client(uri: str) -> object:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def test_params_metrics_by_step_and_tags(store: str, train: Callable[..., list[float]]) -> None:
    accelerator = kwplug.Accelerator(cpu=True, log_with="mlflow")
    accelerator.init_trackers(
        "kwplug-test",
        config={"lr": 0.1, "batch_size": 8, "optim": {"name": "sgd"}},
        init_kwargs={"mlflow": {"tags": {"team": "k"}, "run_name": "first"}},
    )
    active = accelerator.get_tracker("mlflow", unwrap=True)
    losses = train(accelerator, more=lambda step: {"epoch": step})
    accelerator.end_training()

    (run,) = mlflow.search_runs(experiment_names=["kwplug-test"], output_format="list")
    assert run.info.run_id == active.info.run_id and run.info.status == "FINISHED"
    assert run.info.run_name == "first" and run.data.tags["team"] == "k"
    assert run.data.params == {"lr": "0.1", "batch_size": "8", "optim": "{'name': 'sgd'}"}
    history = client(store).get_metric_history(run.info.run_id, "loss")  # type: ignore[attr-defined]
    assert [(m.step, m.value) for m in history] == [
        (s, pytest.approx(v)) for s, v in zip([1, 2, 3], losses, strict=True)
    ]
    assert run.data.metrics["epoch"] == 3


def test_strings_are_dropped_with_one_warning(store: str) -> None:
    accelerator = kwplug.Accelerator(cpu=True, log_with="mlflow")
    accelerator.init_trackers("kwplug-test")
    with pytest.warns(UserWarning, match="'note' is a str") as caught:
        accelerator.log({"acc": 0.5, "note": "hi"}, step=0)
        accelerator.log({"acc": 0.75, "note": "again"}, step=1)
    assert len([w for w in caught if "'note'" in str(w.message)]) == 1
    run_id = accelerator.get_tracker("mlflow", unwrap=True).info.run_id
    accelerator.end_training()
    run = client(store).get_run(run_id)  # type: ignore[attr-defined]
    assert run.data.metrics == {"acc": 0.75}


def test_over_long_param_is_left_out_with_a_warning(store: str) -> None:
    accelerator = kwplug.Accelerator(cpu=True, log_with="mlflow")
    with pytest.warns(TrackerConfigWarning, match="'prompt'") as caught:
        accelerator.init_trackers("kwplug-test", config={"prompt": "x" * 7000, "lr": 1})
    assert caught[0].message.keys == ("prompt",)  # type: ignore[union-attr]
    run_id = accelerator.get_tracker("mlflow", unwrap=True).info.run_id
    accelerator.end_training()
    assert client(store).get_run(run_id).data.params == {"lr": "1"}  # type: ignore[attr-defined]


def test_many_params_go_in_batches(store: str) -> None:
    accelerator = kwplug.Accelerator(cpu=True, log_with="mlflow")
    accelerator.init_trackers("kwplug-test", config={f"p{i}": i for i in range(250)})
    run_id = accelerator.get_tracker("mlflow", unwrap=True).info.run_id
    accelerator.end_training()
    assert len(client(store).get_run(run_id).data.params) == 250  # type: ignore[attr-defined]


def test_environment_wins_as_in_accelerate(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    monkeypatch.setenv("MLFLOW_TAGS", '{"source": "env"}')
    tracker = MLflowTracker("from-code", tags={"source": "code"})
    assert tracker.experiment_name == "from-env" and tracker.tags == {"source": "env"}
    accelerator = kwplug.Accelerator(cpu=True, log_with="mlflow")
    accelerator.init_trackers("from-code")
    accelerator.end_training()
    (run,) = mlflow.search_runs(experiment_names=["from-env"], output_format="list")
    assert run.data.tags["source"] == "env"


def test_tracking_uri_argument(tmp_path: Path, store: str) -> None:
    other = (tmp_path / "elsewhere").as_uri()
    accelerator = kwplug.Accelerator(cpu=True, log_with="mlflow")
    accelerator.init_trackers("kwplug-test", init_kwargs={"mlflow": {"tracking_uri": other}})
    accelerator.log({"a": 1.0}, step=0)
    accelerator.end_training()
    assert (tmp_path / "elsewhere").is_dir()
    (run,) = client(other).search_runs(  # type: ignore[attr-defined]
        [client(other).get_experiment_by_name("kwplug-test").experiment_id]  # type: ignore[attr-defined]
    )
    assert run.data.metrics == {"a": 1.0}


def test_missing_mlflow_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)
    accelerator = kwplug.Accelerator(cpu=True, log_with="mlflow")
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'kwplug\[mlflow\]'"):
        accelerator.init_trackers("p")


def test_run_matches_accelerate(
    tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import accelerate

    def log_a_run(accelerator: object, uri: str) -> dict[str, object]:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        mlflow.set_tracking_uri(uri)
        accelerator.init_trackers("parity", {"lr": 2e-5, "epochs": 2, "name": "x"})  # type: ignore[attr-defined]
        for epoch in range(2):
            values = {"accuracy": 0.75 + epoch / 10, "train_loss": 0.5 / (epoch + 1)}
            accelerator.log({**values, "epoch": epoch}, step=epoch)  # type: ignore[attr-defined]
        accelerator.end_training()  # type: ignore[attr-defined]
        (run,) = mlflow.search_runs(experiment_names=["parity"], output_format="list")
        metrics = {
            name: [(m.step, m.value) for m in client(uri).get_metric_history(run.info.run_id, name)]  # type: ignore[attr-defined]
            for name in run.data.metrics
        }
        return {"params": run.data.params, "metrics": metrics, "status": run.info.status}

    try:
        theirs = log_a_run(
            accelerate.Accelerator(cpu=True, log_with="mlflow"), (tmp_path / "a").as_uri()
        )
    finally:
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    ours = log_a_run(kwplug.Accelerator(cpu=True, log_with="mlflow"), (tmp_path / "k").as_uri())
    assert ours == theirs and set(ours["metrics"]) == {"accuracy", "train_loss", "epoch"}  # type: ignore[arg-type]

"""The wandb tracker plugin: offline runs read back from the run file, init_kwargs, images,
the missing-package message, and a run that matches Accelerate's."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from wandb_records import read_run, run_folder

import kwplug
from kwplug.plugins.wandb_tracker import WandBTracker

pytest.importorskip("wandb")


@pytest.fixture(autouse=True)
def _fresh_wandb() -> Iterator[None]:
    # wandb reads WANDB_DIR once per process (its setup singleton): reset it around each test.
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


def test_offline_run_holds_config_and_metrics_by_step(
    offline_dir: Path, train: Callable[..., list[float]]
) -> None:
    accelerator = kwplug.Accelerator(cpu=True, log_with="wandb")
    config = {"lr": 0.1, "optim": {"name": "sgd"}, "layers": [4, 1]}
    accelerator.init_trackers(
        "kwplug-test", config=config, init_kwargs={"wandb": {"tags": ["t1"], "name": "r"}}
    )
    run = accelerator.get_tracker("wandb", unwrap=True)
    assert run.project == "kwplug-test" and run.name == "r"
    losses = train(accelerator, more=lambda step: {"lr": 0.1})
    accelerator.end_training()

    logged = read_run(run_folder(offline_dir))
    assert logged["project"] == "kwplug-test" and logged["tags"] == ["t1"]
    values = {
        k: v.get("value", v) if isinstance(v, dict) else v for k, v in logged["config"].items()
    }
    assert values["lr"] == 0.1 and values["optim"] == {"name": "sgd"} and values["layers"] == [4, 1]
    history = logged["history"]
    assert [row["_step"] for row in history] == [1, 2, 3]
    assert [row["loss"] for row in history] == pytest.approx(losses)  # 0-d tensors as numbers
    assert {row["lr"] for row in history} == {0.1}


def test_log_images_and_table(offline_dir: Path) -> None:
    np = pytest.importorskip("numpy")
    accelerator = kwplug.Accelerator(cpu=True, log_with="wandb")
    accelerator.init_trackers("kwplug-test")
    tracker = accelerator.get_tracker("wandb")
    assert isinstance(tracker, WandBTracker)
    tracker.log_images({"samples": [np.zeros((8, 8, 3), dtype=np.uint8)]}, step=0)
    tracker.log_table("preds", columns=["x", "y"], data=[[1, 2]], step=1)
    accelerator.end_training()
    history = read_run(run_folder(offline_dir))["history"]
    assert history[0]["samples"]["_type"] == "images/separated"
    assert history[1]["preds"]["_type"] == "table-file"
    assert list((run_folder(offline_dir) / "files" / "media" / "images").glob("samples_0_*.png"))


def test_missing_wandb_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    accelerator = kwplug.Accelerator(cpu=True, log_with="wandb")
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'kwplug\[wandb\]'"):
        accelerator.init_trackers("p")


def test_all_includes_wandb_when_installed(tmp_path: Path, offline_dir: Path) -> None:
    accelerator = kwplug.Accelerator(cpu=True, log_with="all", project_dir=tmp_path)
    assert "wandb" in accelerator._trackers.selected
    assert WandBTracker.is_available()


def _log_a_run(accelerator: object) -> None:
    accelerator.init_trackers("parity", {"lr": 2e-5, "epochs": 2})  # type: ignore[attr-defined]
    for epoch in range(2):
        values = {"accuracy": 0.75 + epoch / 10, "train_loss": 0.5 / (epoch + 1), "epoch": epoch}
        accelerator.log(values, step=epoch)  # type: ignore[attr-defined]
    accelerator.end_training()  # type: ignore[attr-defined]


def _strip(run: dict) -> dict:
    history = [
        {k: v for k, v in row.items() if k not in ("_timestamp", "_runtime")}
        for row in run["history"]
    ]
    config = {k: v for k, v in run["config"].items() if k != "_wandb"}
    return {"project": run["project"], "config": config, "history": history}


def test_run_matches_accelerate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import accelerate

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "a"))
    (tmp_path / "a").mkdir()
    try:
        _log_a_run(accelerate.Accelerator(cpu=True, log_with="wandb"))
    finally:
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    import wandb

    wandb.teardown()
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "k"))
    (tmp_path / "k").mkdir()
    _log_a_run(kwplug.Accelerator(cpu=True, log_with="wandb"))
    theirs = _strip(read_run(run_folder(tmp_path / "a")))
    ours = _strip(read_run(run_folder(tmp_path / "k")))
    assert ours == theirs and len(ours["history"]) == 2

"""Trackers as plugins: the ``trackers`` hook, ``log_with``, ``init_trackers``/``log``/
``get_tracker``, the built-in TensorBoard and JSON-lines trackers, main-process-only runs."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
import torch

import kwplug
from kwplug import KwargsHandler, hookimpl
from kwplug.plugins.trackers import TensorBoardTracker
from kwplug.testing import PluginSandbox, run_distributed
from kwplug.tracking import GeneralTracker

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"


class ListTracker(GeneralTracker):
    """Records every call, for the tests (no logging directory)."""

    name: ClassVar[str] = "list"
    requires_logging_directory: ClassVar[bool] = False
    calls: ClassVar[list[tuple[Any, ...]]] = []

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.calls.append(("init", run_name, kwargs))

    @property
    def tracker(self) -> str:
        return "inner"

    def start(self) -> None:
        self.calls.append(("start",))

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self.calls.append(("config", dict(values)))

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.calls.append(("log", dict(values), step, kwargs))

    def finish(self) -> None:
        self.calls.append(("finish",))


@attrs.define
class ListTrackerPlugin(KwargsHandler):
    """A third-party plugin contributing ``"list"`` (registered through an entry point)."""

    @hookimpl
    def trackers(self) -> Mapping[str, Any]:
        return {"list": ListTracker}


@pytest.fixture(autouse=True)
def _clear_calls() -> None:
    ListTracker.calls.clear()


def test_hook_trackers() -> None:
    @attrs.define
    class Contributes(KwargsHandler):
        @hookimpl
        def trackers(self) -> Any:
            return {"list": ListTracker}

    accelerator = kwplug.Accelerator(cpu=True, log_with="list", kwargs_handlers=[Contributes()])
    accelerator.init_trackers("proj", config={"lr": 0.1}, init_kwargs={"list": {"tag": "a"}})
    accelerator.log({"loss": 1.5}, step=3, log_kwargs={"list": {"commit": True}})
    assert accelerator.get_tracker("list", unwrap=True) == "inner"
    assert isinstance(accelerator.get_tracker("list"), ListTracker)
    accelerator.end_training()
    assert ListTracker.calls == [
        ("init", "proj", {"tag": "a"}),
        ("start",),
        ("config", {"lr": 0.1}),
        ("log", {"loss": 1.5}, 3, {"commit": True}),
        ("finish",),
    ]
    assert accelerator.trackers == []  # finished once; end_training twice is harmless


def test_third_party_tracker_from_an_entry_point(kwplug_plugins: PluginSandbox) -> None:
    record = kwplug_plugins.add(ListTrackerPlugin, name="list", distribution="kwplug-list")
    assert record.status == "loaded" and record.hooks == ("trackers",)
    accelerator = kwplug_plugins.accelerator(cpu=True, log_with=["list"])
    accelerator.init_trackers("run")
    accelerator.log({"x": 1})
    assert [c[0] for c in ListTracker.calls] == ["init", "start", "log"]


def test_unknown_tracker_lists_the_available_ones() -> None:
    available = r"available: (.*, )?'jsonl', 'mlflow', 'tensorboard', 'wandb'(, .*)? \(or 'all'\)"
    with pytest.raises(ValueError, match=rf"unknown tracker 'neptune'; {available}"):
        kwplug.Accelerator(cpu=True, log_with="neptune")
    with pytest.raises(TypeError, match="log_with must be"):
        kwplug.Accelerator(cpu=True, log_with=[3])  # type: ignore[list-item]


def test_file_trackers_need_a_logging_directory() -> None:
    with pytest.raises(ValueError, match="'jsonl' writes files.*project_dir"):
        kwplug.Accelerator(cpu=True, log_with="jsonl")


def test_duplicate_tracker_names_are_an_error() -> None:
    @attrs.define
    class Again(KwargsHandler):
        @hookimpl
        def trackers(self) -> Any:
            return {"jsonl": ListTracker}

    with pytest.raises(ValueError, match="'jsonl' is provided twice"):
        kwplug.Accelerator(cpu=True, log_with="all", kwargs_handlers=[Again()])


def test_no_log_with_never_calls_the_hook() -> None:
    @attrs.define
    class Boom(KwargsHandler):
        @hookimpl
        def trackers(self) -> Any:
            raise AssertionError("called without log_with")

    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[Boom()])
    accelerator.init_trackers("p")
    accelerator.log({"a": 1})
    assert accelerator.trackers == []


def test_tracker_instance_and_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # "all" starts every installed tracker, some writing to the working folder by default
    # (dvclive/, as under Accelerate): run it in tmp_path.
    monkeypatch.chdir(tmp_path)
    mine = ListTracker("given")
    accelerator = kwplug.Accelerator(cpu=True, log_with=["all", mine], project_dir=tmp_path)
    selected = accelerator._trackers.selected
    assert "jsonl" in selected and mine in selected
    assert ("tensorboard" in selected) is TensorBoardTracker.is_available()
    accelerator.init_trackers("p")
    assert accelerator.get_tracker("list") is mine
    with pytest.raises(ValueError, match="'nope' is not a tracker"):
        accelerator.get_tracker("nope")
    accelerator.end_training()


def test_incomplete_tracker_class_is_refused() -> None:
    class Bad(GeneralTracker):
        name = "bad"

    with pytest.raises(NotImplementedError, match="`requires_logging_directory`, `tracker`"):
        Bad()


def test_jsonl_writes_one_flushed_line_per_log(tmp_path: Path) -> None:
    accelerator = kwplug.Accelerator(cpu=True, log_with="jsonl", project_dir=tmp_path)
    accelerator.init_trackers("run", config={"lr": 0.5, "name": "x"})
    accelerator.log({"loss": torch.tensor(0.25), "epoch": 1}, step=7)
    accelerator.log({"acc": 0.5})
    path = tmp_path / "run" / "log.jsonl"
    lines = path.read_text().splitlines()  # before finish: flushed already
    assert [json.loads(line) for line in lines] == [
        {"step": 7, "loss": 0.25, "epoch": 1},
        {"step": None, "acc": 0.5},
    ]
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"lr": 0.5, "name": "x"}
    accelerator.end_training()
    assert accelerator.trackers == []


def test_tensorboard_missing_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    accelerator = kwplug.Accelerator(cpu=True, log_with="tensorboard", project_dir=tmp_path)
    with pytest.raises(ModuleNotFoundError, match=r"kwplug\[tensorboard\]"):
        accelerator.init_trackers("run")


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    ).EventAccumulator(str(run_dir))
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def test_tensorboard_event_file_holds_the_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    accelerator = kwplug.Accelerator(cpu=True, log_with="tensorboard", project_dir=tmp_path)
    accelerator.init_trackers("run", config={"lr": 0.1})
    for step in range(3):
        accelerator.log({"loss": 1.0 / (step + 1), "note": "text"}, step=step)
    accelerator.end_training()
    assert _scalars(tmp_path / "run")["loss"] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]


@pytest.mark.parametrize("tracker", ["tensorboard", "jsonl"])
def test_example_writes_loss_and_accuracy_curves(tmp_path: Path, tracker: str) -> None:
    if tracker == "tensorboard":
        pytest.importorskip("tensorboard")
    from python import python  # (not at the top: ranks of run_distributed import this module)

    command = [str(EXAMPLE), "--cpu", "--epochs", "2", "--no-progress"]
    command += ["--log-with", tracker, "--project-dir", str(tmp_path)]
    python(*command, check=True, timeout=240)
    run_dir = tmp_path / "train_digits"
    if tracker == "jsonl":
        rows = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        assert all({"train_loss", "test_accuracy"} <= r.keys() for r in rows)
    else:
        curves = _scalars(run_dir)
        assert [s for s, _ in curves["train_loss"]] == [1, 2]
        assert [s for s, _ in curves["test_accuracy"]] == [1, 2]
        assert curves["train_loss"][1][1] < curves["train_loss"][0][1]


def log_on_both_ranks(directory: str) -> tuple[int, bool, int]:
    """Rank body: every rank logs; only rank 0 has a tracker and writes."""
    accelerator = kwplug.Accelerator(cpu=True, log_with="jsonl", project_dir=directory)
    accelerator.init_trackers("run")
    accelerator.log({"rank": accelerator.process_index}, step=0)
    blank = type(accelerator.get_tracker("jsonl")) is GeneralTracker
    count = len(accelerator.trackers)
    accelerator.end_training()
    return accelerator.process_index, blank, count


def test_trackers_run_on_the_main_process_only(tmp_path: Path) -> None:
    results = run_distributed(log_on_both_ranks, str(tmp_path), nproc=2, timeout=180)
    assert results == [(0, False, 1), (1, True, 0)]
    lines = (tmp_path / "run" / "log.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 0, "rank": 0}]


def _log_a_run(accelerator: Any) -> None:
    # What Accelerate's by_feature/tracking.py logs: a config, then per epoch a float
    # accuracy/f1, a float train_loss (from a tensor's .item()) and an int epoch.
    accelerator.init_trackers("tracking", {"lr": 2e-5, "num_epochs": 2, "seed": 42})
    for epoch in range(2):
        loss = torch.tensor(0.5 / (epoch + 1))
        values = {"accuracy": 0.75 + epoch / 10, "train_loss": loss.item(), "epoch": epoch}
        accelerator.log(values, step=epoch)
    accelerator.end_training()


def test_tensorboard_run_matches_accelerate(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    import accelerate

    try:
        _log_a_run(
            accelerate.Accelerator(cpu=True, log_with="tensorboard", project_dir=tmp_path / "a")
        )
    finally:
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    _log_a_run(kwplug.Accelerator(cpu=True, log_with="tensorboard", project_dir=tmp_path / "k"))
    theirs, ours = _scalars(tmp_path / "a" / "tracking"), _scalars(tmp_path / "k" / "tracking")
    assert ours == theirs and set(ours) == {"accuracy", "train_loss", "epoch"}

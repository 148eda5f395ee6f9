"""Two jsonl runs with one name in one ``project_dir`` never share a log (issue 30, item 7):
the second used to overwrite the first's ``config.json`` and append to its ``log.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kwplug
from kwplug.errors import KwplugWarning


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(project: Path, lr: float, loss: float, **init_kwargs: object) -> kwplug.Accelerator:
    accelerator = kwplug.Accelerator(cpu=True, log_with="jsonl", project_dir=project)
    accelerator.init_trackers("run", config={"lr": lr}, init_kwargs={"jsonl": init_kwargs})
    accelerator.log({"loss": loss}, step=1)
    return accelerator


def test_two_live_runs_with_one_name_get_their_own_folders(tmp_path: Path) -> None:
    first = _run(tmp_path, 0.1, 1.0)
    with pytest.warns(KwplugWarning, match=r"belongs to another run of 'run'.*run-1"):
        second = _run(tmp_path, 0.2, 2.0)
    first.log({"loss": 0.5}, step=2)
    assert _lines(tmp_path / "run" / "log.jsonl") == [
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 0.5},
    ]
    assert _lines(tmp_path / "run-1" / "log.jsonl") == [{"step": 1, "loss": 2.0}]
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"lr": 0.1}
    assert json.loads((tmp_path / "run-1" / "config.json").read_text()) == {"lr": 0.2}
    assert second.get_tracker("jsonl").directory == tmp_path / "run-1"
    first.end_training()
    second.end_training()


def test_a_later_run_does_not_append_to_an_ended_run(tmp_path: Path) -> None:
    _run(tmp_path, 0.1, 1.0).end_training()
    with pytest.warns(KwplugWarning):
        _run(tmp_path, 0.2, 2.0).end_training()
    with pytest.warns(KwplugWarning, match="run-2"):
        _run(tmp_path, 0.3, 3.0).end_training()
    assert _lines(tmp_path / "run" / "log.jsonl") == [{"step": 1, "loss": 1.0}]
    assert _lines(tmp_path / "run-2" / "log.jsonl") == [{"step": 1, "loss": 3.0}]


def test_append_continues_the_existing_log(
    tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    _run(tmp_path, 0.1, 1.0).end_training()
    _run(tmp_path, 0.1, 0.5, append=True).end_training()
    assert not [w for w in recwarn if issubclass(w.category, KwplugWarning)]
    assert _lines(tmp_path / "run" / "log.jsonl") == [
        {"step": 1, "loss": 1.0},
        {"step": 1, "loss": 0.5},
    ]
    assert not (tmp_path / "run-1").exists()


def test_append_must_be_a_bool(tmp_path: Path) -> None:
    accelerator = kwplug.Accelerator(cpu=True, log_with="jsonl", project_dir=tmp_path)
    with pytest.raises(TypeError, match="append must be a bool, got str"):
        accelerator.init_trackers("run", init_kwargs={"jsonl": {"append": "yes"}})

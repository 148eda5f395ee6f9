"""kwplug-dvclive, installed as a third-party distribution: discovered through the
``trackers`` hook, a few training steps logged, read back with DVCLive's own readers.

Needs kwplug-dvclive installed (``pip install ./examples/plugins/kwplug-dvclive``, which
brings ``dvclive``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import kwplug
from kwplug import cli

pytest.importorskip("kwplug_dvclive", reason="pip install ./examples/plugins/kwplug-dvclive")
dvclive = pytest.importorskip("dvclive")

from dvclive.serialize import load_yaml  # noqa: E402  (after the skips)
from dvclive.utils import read_history, read_latest  # noqa: E402
from kwplug_dvclive import DVCLiveTracker  # noqa: E402


def live_kwargs(folder: Path) -> dict[str, Any]:
    # save_dvc_exp=False: no DVC experiment (no DVC repository in a test's folder).
    return {"dir": str(folder), "save_dvc_exp": False}


def train(accelerator: kwplug.Accelerator, steps: int = 3) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    losses = []
    for step in range(1, steps + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.detach(), "lr": 0.1}, step=step)
        losses.append(loss.item())
    return losses


def test_discovered_as_a_third_party_tracker() -> None:
    rows = {row["tracker"]: row for row in cli.tracker_rows()}
    assert rows["dvclive"]["status"] == "available"
    assert "kwplug-dvclive" in rows["dvclive"]["plugin"]
    (record,) = [r for r in cli.plugin_rows(kwplug.discover()) if r["name"] == "dvclive"]
    assert record["source"] == "third-party" and record["hooks"] == ["trackers"]


def test_params_and_metrics_by_step(tmp_path: Path) -> None:
    accelerator = kwplug.Accelerator(cpu=True, log_with="dvclive")
    config = {"lr": 0.1, "optim": {"name": "sgd"}, "layers": [4, 1]}
    folder = tmp_path / "live"
    accelerator.init_trackers("kwplug-test", config, init_kwargs={"dvclive": live_kwargs(folder)})
    live = accelerator.get_tracker("dvclive", unwrap=True)
    assert isinstance(live, dvclive.Live)
    losses = train(accelerator)
    accelerator.end_training()

    assert load_yaml(live.params_file) == config
    steps, values = read_history(live, "loss")
    assert steps == [1, 2, 3] and values == pytest.approx(losses)
    assert read_latest(live, "lr") == (3, 0.1)
    assert (folder / "plots" / "metrics" / "loss.tsv").is_file()


def test_strings_are_left_out_with_one_warning(tmp_path: Path) -> None:
    accelerator = kwplug.Accelerator(cpu=True, log_with="dvclive")
    accelerator.init_trackers("p", init_kwargs={"dvclive": live_kwargs(tmp_path)})
    with pytest.warns(UserWarning, match="'note' is a str") as caught:
        accelerator.log({"acc": 0.5, "note": "a"}, step=0)
        accelerator.log({"acc": 0.75, "note": "b"}, step=1)
    assert len([w for w in caught if "'note'" in str(w.message)]) == 1
    live = accelerator.get_tracker("dvclive", unwrap=True)
    accelerator.end_training()
    assert read_history(live, "acc") == ([0, 1], [0.5, 0.75])


def test_log_images(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    accelerator = kwplug.Accelerator(cpu=True, log_with="dvclive")
    accelerator.init_trackers("p", init_kwargs={"dvclive": live_kwargs(tmp_path)})
    tracker = accelerator.get_tracker("dvclive")
    assert isinstance(tracker, DVCLiveTracker)
    tracker.log_images({"sample.png": np.zeros((8, 8, 3), dtype=np.uint8)})
    accelerator.end_training()
    assert (tmp_path / "plots" / "images" / "sample.png").is_file()


def test_missing_dvclive_names_the_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dvclive", None)
    accelerator = kwplug.Accelerator(cpu=True, log_with="dvclive")
    with pytest.raises(ModuleNotFoundError, match="pip install 'kwplug-dvclive'"):
        accelerator.init_trackers("p")

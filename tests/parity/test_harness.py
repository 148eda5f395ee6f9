"""The harness's own pieces: the import rename and the comparison (no subprocesses)."""

from __future__ import annotations

import re

import harness
import pytest
import torch
from harness import Run


def test_rename_touches_only_accelerate_imports() -> None:
    source = (
        "import argparse\n"
        "from accelerate import Accelerator, DistributedType\n"
        "from accelerate.utils import set_seed\n"
        "    from accelerate.local_sgd import LocalSGD\n"
        "import accelerate\n"
        "# accelerate is great; from accelerate import nothing here\n"
        "x = 'from accelerate import Accelerator'\n"
        "from accelerated import thing\n"
    )
    assert harness.rename_imports(source) == (
        "import argparse\n"
        "from kwplug import Accelerator, DistributedType\n"
        "from kwplug.utils import set_seed\n"
        "    from kwplug.local_sgd import LocalSGD\n"
        "import kwplug\n"
        "# accelerate is great; from accelerate import nothing here\n"
        "x = 'from accelerate import Accelerator'\n"
        "from accelerated import thing\n"
    )


@pytest.mark.parametrize(
    "line", ["from accelerate.test_utils import x\n", "import accelerate.state\n"]
)
def test_rename_refuses_modules_kwplug_does_not_promise(line: str) -> None:
    with pytest.raises(ValueError, match="cannot rename import of accelerate"):
        harness.rename_imports(line)


def test_tracking_import_renames() -> None:
    line = "from accelerate.tracking import GeneralTracker\n"
    assert harness.rename_imports(line) == "from kwplug.tracking import GeneralTracker\n"


def test_every_port_renames_cleanly() -> None:
    for scenario in harness.SCENARIOS.values():
        renamed = harness.rename_imports((harness.SCRIPTS / f"{scenario.script}.py").read_text())
        assert not re.search(r"^\s*(from|import)\s+accelerate\b", renamed, re.MULTILINE)
        assert "from kwplug import" in renamed


def _run(train_ids: list[list[int]], weights: str = "w") -> Run:
    epoch = {
        "train_ids": train_ids,
        "train_samples": sum(map(len, train_ids)),
        "eval_ids": [[9]],
        "eval_gathered": 1,
        "metric": 0.5,
    }
    record = {"rank": 0, "world_size": 1, "epochs": [epoch], "weights_sha256": [weights]}
    return Run(["python"], 0, "", [record])


def test_compare_reports_batches_counts_and_weights() -> None:
    assert harness.compare(_run([[1, 2], [3]]), _run([[1, 2], [3]]), weights=True) == []
    problems = harness.compare(_run([[1, 2], [3]]), _run([[2, 1]], "v"), weights=True)
    assert problems == [
        "rank 0 epoch 0: train_samples 2, expected 3",
        "rank 0 epoch 0: train_ids differ first at batch 0: [2, 1], expected [1, 2]",
        "rank 0: final weights differ (sha256 of each model's state dict)",
    ]
    assert harness.compare(_run([[1]]), _run([[1]], "v"), weights=False) == []


def test_failed_run_reports_first_traceback_and_tail() -> None:
    output = (
        "Traceback (most recent call last):\nImportError: kwplug.utils\n"
        + "torchrun noise\n" * 1000
        + "ChildFailedError"
    )
    report = Run(["python", "x.py"], 1, output, []).failure() or ""
    assert "ImportError: kwplug.utils" in report
    assert report.endswith("ChildFailedError")
    assert Run(["python"], 0, "", []).failure() == (
        "no record written: python\n--- output tail ---\n"
    )
    assert _run([[1]]).failure() is None


def test_toy_digits_are_scikit_learns(monkeypatch: pytest.MonkeyPatch) -> None:
    from sklearn.datasets import load_digits

    monkeypatch.syspath_prepend(str(harness.SCRIPTS))
    import _toy

    digits = load_digits()
    splits = _toy.load_digits_splits()
    train, validation = splits["train"], splits["validation"]
    assert (len(train), len(validation)) == (1000, 297)
    assert torch.equal(train.features, torch.tensor(digits.data[:1000], dtype=torch.float32) / 16)
    assert torch.equal(validation["label"], torch.tensor(digits.target[1000:1297]))
    assert validation[0]["idx"] == 1000
    subset = train.select([5, 2])
    assert [subset[i]["idx"] for i in range(2)] == [5, 2]
    assert subset.num_rows == 2

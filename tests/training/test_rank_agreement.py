"""Ranks that construct their Accelerators differently stop at construction, every rank naming
the setting and each rank's value (issue 18 item 3); 2 processes under torchrun (gloo)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torchrun import torchrun

WORKERS = Path(__file__).parents[1] / "workers"


def run(scenario: str, tmp_path: Path, ranks: int = 2) -> tuple[int, list[dict[str, Any]]]:
    """torchrun's exit status and what ranks ``0 .. ranks-1`` wrote."""
    worker = WORKERS / "rank_agreement.py"
    done = torchrun(worker, scenario, str(tmp_path), timeout=120, check=False)
    files = [tmp_path / f"rank_{rank}.json" for rank in range(ranks)]
    assert all(f.exists() for f in files), done.stdout[-4000:] + done.stderr[-4000:]
    return done.returncode, [json.loads(f.read_text()) for f in files]


@pytest.mark.parametrize(
    ("scenario", "field", "values"),
    [
        ("mixed_precision", "mixed_precision", ['"bf16"', '"no"']),
        ("gradient_accumulation_steps", "gradient_accumulation_steps", ["2", "4"]),
        ("bucket_cap_mb", "DistributedDataParallelKwargs.bucket_cap_mb", ["10", "50"]),
        ("comm_hook", "DistributedDataParallelKwargs.comm_hook", ['"fp16"', '"no"']),
        (
            "power_sgd_rank",
            "DistributedDataParallelKwargs.comm_state_option",
            ['{"matrix_approximation_rank": 1}', '{"matrix_approximation_rank": 2}'],
        ),
        ("plugins", "plugin 'profile'", [None, "<absent>"]),
        ("torch_version", "torch version", [f'"{torch.__version__}"', '"2.12.1+cpu"']),
    ],
)
def test_a_setting_that_differs_stops_every_rank_naming_it(
    scenario: str, field: str, values: list[str | None], tmp_path: Path
) -> None:
    returncode, ranks = run(scenario, tmp_path)
    assert returncode != 0
    for rank in ranks:
        assert rank["type"] == "RankMismatchError", rank
        assert rank["field"] == field
        for expected, got in zip(values, rank["values"], strict=True):
            assert expected is None or got == expected
        assert field in rank["message"]
        for rank_index, value in enumerate(rank["values"]):
            assert f"{value} on rank {rank_index}" in rank["message"]
    assert ranks[0]["message"] == ranks[1]["message"]
    if scenario == "plugins":
        assert ranks[0]["values"][0].startswith('"kwplug ')


def test_equal_settings_pass_and_train(tmp_path: Path) -> None:
    # A handler with default values given on one rank only is the same setting.
    returncode, ranks = run("agree", tmp_path)
    assert returncode == 0
    assert ranks == [{"ok": True}, {"ok": True}]


def test_a_rank_that_never_constructs_an_accelerator_fails_the_others_at_the_timeout(
    tmp_path: Path,
) -> None:
    # Process-group timeout 3 s: rank 0 must not wait for rank 1 (asleep for 20 s) forever.
    returncode, ranks = run("absent_rank", tmp_path, ranks=1)
    assert returncode != 0
    assert ranks[0]["type"] == "RuntimeError"
    assert "every rank must construct each Accelerator()" in ranks[0]["message"]
    assert ranks[0]["seconds"] < 15

"""Settings assigned after ``Accelerator()`` and ``project_config`` are compared across ranks at
kwplug's next collective, and no kwplug collective waits for an absent rank beyond
``KWPLUG_RANK_WAIT`` without naming it (issue 30 item 2); 2 processes under torchrun (gloo).

Before: rank 1 setting ``gradient_accumulation_steps`` after construction trained on (one rank
exited 0, the other died of gloo's "Connection closed by peer"); only rank 0 using automatic
naming made ``save_state`` wait out the group timeout (1800 s); a rank that never reached
``wait_for_everyone`` was waited for as long, naming nothing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from torchrun import torchrun

WORKERS = Path(__file__).parents[1] / "workers"
BOUND = 4.0  # KWPLUG_RANK_WAIT in these jobs, seconds


def run(scenario: str, tmp_path: Path, **env: str) -> tuple[int, list[dict[str, Any]], float]:
    """torchrun's exit status, what each rank wrote, and the job's seconds."""
    started = time.monotonic()
    done = torchrun(
        WORKERS / "rank_agreement_live.py",
        scenario,
        str(tmp_path),
        timeout=150,
        check=False,
        env={"KWPLUG_RANK_WAIT": f"{BOUND:g}", "KWPLUG_SAVE_STATE_WAIT": "1", **env},
    )
    seconds = time.monotonic() - started
    files = [tmp_path / f"rank_{rank}.json" for rank in range(2)]
    assert all(f.exists() for f in files), done.stdout[-4000:] + done.stderr[-4000:]
    return done.returncode, [json.loads(f.read_text()) for f in files], seconds


@pytest.mark.parametrize(
    ("scenario", "field", "values", "at"),
    [
        ("steps", "gradient_accumulation_steps", ["1", "4"], "prepare"),
        ("steps_after_prepare", "gradient_accumulation_steps", ["1", "4"], "backward"),
        ("even_batches", "dataloader_config.even_batches", ["true", "false"], "prepare"),
        ("naming", "project_config.automatic_checkpoint_naming", ["true", "false"], "save_state"),
        ("total_limit_load", "project_config.total_limit", ["null", "2"], "load_state"),
    ],
)
def test_a_setting_assigned_on_one_rank_stops_every_rank_naming_it(
    scenario: str, field: str, values: list[str], at: str, tmp_path: Path
) -> None:
    # A wait of 60 s: the ranks stop at once (digests differ), long before it.
    returncode, ranks, _ = run(scenario, tmp_path, KWPLUG_RANK_WAIT="60")
    assert returncode != 0
    for rank in ranks:
        assert rank["type"] == "RankMismatchError", rank
        assert rank["field"] == field
        assert rank["values"] == values
        assert f"reached {at} with different settings" in rank["message"]
        for index, value in enumerate(values):
            assert f"{field}: " in rank["message"]
            assert f"{value} on rank {index}" in rank["message"]
        assert rank["seconds"] < 40  # prepare, a step and the check on 2 shared cores
    assert ranks[0]["message"] == ranks[1]["message"]
    if scenario == "naming":  # nothing was written: the mismatch comes before the save
        assert not (tmp_path / "explicit").exists()
        assert not (tmp_path / "project" / "checkpoints").exists()


def test_automatic_naming_on_rank_0_only_stops_both_at_construction(tmp_path: Path) -> None:
    # The same, given at construction: Accelerator() compares project_config too.
    returncode, ranks, _ = run("construct_naming", tmp_path)
    assert returncode != 0
    for rank in ranks:
        assert rank["type"] == "RankMismatchError", rank
        assert rank["field"] == "project_config.automatic_checkpoint_naming"
        assert rank["values"] == ["true", "false"]
        assert "constructed Accelerator() with different settings" in rank["message"]


@pytest.mark.parametrize(
    ("scenario", "waiting", "absent", "at"),
    [
        ("absent_barrier", 0, 1, "wait_for_everyone"),
        ("absent_load", 0, 1, "load_state"),
        ("absent_main", 1, 0, "save_state"),
    ],
)
def test_a_rank_that_never_arrives_is_named_within_the_bound(
    scenario: str, waiting: int, absent: int, at: str, tmp_path: Path
) -> None:
    returncode, ranks, _ = run(scenario, tmp_path)
    assert returncode != 0
    error = ranks[waiting]
    assert error["type"] == "RankTimeoutError", error
    assert error["missing"] == [absent]
    assert error["waited_for"] == at
    assert f"rank {absent} did not arrive" in error["message"]
    assert "KWPLUG_RANK_WAIT" in error["message"]
    assert BOUND - 0.5 <= error["seconds"] < BOUND + 10
    assert ranks[absent]["ok"] is True


def test_equal_settings_and_a_main_process_save_pass(tmp_path: Path) -> None:
    # Settings assigned after construction on every rank agree; a save by the main process
    # alone (legal, warned) advances only rank 0's iteration, and load_state still agrees.
    returncode, ranks, _ = run("agree", tmp_path)
    assert returncode == 0, ranks
    for rank in ranks:
        assert rank == {"ok": True, "got": {"loaded": "checkpoint_1", "iteration": 2}}
    checkpoints = tmp_path / "project" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")) == [
        "checkpoint_0",
        "checkpoint_1",
    ]


def test_a_malformed_bound_is_refused(tmp_path: Path) -> None:
    returncode, ranks, _ = run("absent_barrier", tmp_path, KWPLUG_RANK_WAIT="soon")
    assert returncode != 0
    assert ranks[0]["type"] == "ValueError"
    assert "KWPLUG_RANK_WAIT must be a number of seconds > 0, got 'soon'" in ranks[0]["message"]

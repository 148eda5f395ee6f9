"""``multi_device``, ``is_fsdp2``, ``is_composable_parallelism_enabled``,
``should_save_model`` and ``verify_device_map`` answer as Accelerate's, in 1 and 2 processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kwplug
from kwplug.testing import run_distributed

NAMES = ("multi_device", "is_fsdp2", "is_composable_parallelism_enabled", "should_save_model")


def _answers(accelerator: Any) -> dict[str, Any]:
    mapped = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    single = torch.nn.Sequential(torch.nn.Linear(2, 2))
    mapped[0].hf_device_map = {"0": "cpu", "1": "disk"}  # type: ignore[assignment]
    single.hf_device_map = {"": "cpu"}  # type: ignore[assignment]
    answers = {name: getattr(accelerator, name) for name in NAMES}
    answers["maps"] = [accelerator.verify_device_map(m) for m in (mapped, single)]
    answers["prepared"] = accelerator.prepare(torch.nn.Linear(2, 2)) is not None
    answers["after_prepare"] = {name: getattr(accelerator, name) for name in NAMES}
    return answers


def test_one_process_matches_accelerate() -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        theirs = _answers(accelerate.Accelerator(cpu=True))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    ours = _answers(kwplug.Accelerator(cpu=True))
    assert ours == theirs
    assert ours["maps"] == [True, False]


def members_in_both_libraries() -> dict[str, dict[str, Any]]:
    import accelerate

    ours = _answers(kwplug.Accelerator(cpu=True))
    theirs = _answers(accelerate.Accelerator(cpu=True))
    return {"kwplug": ours, "accelerate": theirs}


def test_two_processes_match_accelerate() -> None:
    pytest.importorskip("accelerate")
    ranks = run_distributed(members_in_both_libraries, nproc=2, timeout=180)
    for rank in ranks:
        assert rank["kwplug"] == rank["accelerate"]
    assert [r["kwplug"]["should_save_model"] for r in ranks] == [True, False]

"""Issue 28, item 4: resuming a checkpoint folder Accelerate's ``save_state`` wrote.

scripts/accelerate_resume.py is run under Accelerate in 2 gloo CPU processes and saves
mid-run (mid-accumulation, mid-epoch); the same folder is then resumed by Accelerate and by the
script with its imports renamed, under kwplug (which said "no complete kwplug checkpoint"
before). Compared with ``torch.equal``: the final weights, the optimizer's state (steps,
moments), the scheduler's state, the registered object, the values drawn from torch's,
NumPy's and Python's RNGs right after the load, the batches trained and which of them
synchronised (Accelerate's ``step``, restored mid-window).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import harness
import pytest
import torch

from kwplug.testing.distributed import run_torchrun

pytestmark = [pytest.mark.parity, pytest.mark.multiprocess, pytest.mark.timeout(600)]

SCRIPT = harness.SCRIPTS / "accelerate_resume.py"


def _run(system: str, work: Path, *args: str) -> str:
    script = SCRIPT
    if system == "kwplug":
        script = work / "kwplug_accelerate_resume.py"
        script.write_text(harness.rename_imports(SCRIPT.read_text()))
    done = run_torchrun(
        [str(script), "--checkpoint", str(work / "accelerate_ckpt"), *args],
        nproc=2,
        timeout=150,
        env={"ACCELERATE_USE_CPU": "1"},
        cwd=str(work),
    )
    assert done.returncode == 0, f"{system} {args}: exit {done.returncode}\n{done.stdout[-6000:]}"
    return done.stdout


def _records(prefix: Path) -> list[dict[str, Any]]:
    # The test's own files, written by the scripts it ran: trusted.
    return [torch.load(f"{prefix}.rank{r}.pt", weights_only=False) for r in range(2)]


def _equal(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {a.keys()} {b.keys()}"
        for key in a:
            _equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {b!r}, expected {a!r}"


def test_kwplug_resumes_accelerate_checkpoint_as_accelerate(tmp_path: Path) -> None:
    _run("accelerate", tmp_path, "--save", "--record", str(tmp_path / "unused"))
    saved = sorted(p.name for p in (tmp_path / "accelerate_ckpt").iterdir())
    assert saved == [
        "custom_checkpoint_0.pkl",
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "scheduler.bin",
    ]
    _run("accelerate", tmp_path, "--record", str(tmp_path / "accelerate"))
    output = _run("kwplug", tmp_path, "--record", str(tmp_path / "kwplug"))
    assert "no complete kwplug checkpoint" not in output
    reference, resumed = _records(tmp_path / "accelerate"), _records(tmp_path / "kwplug")
    for rank, (a, b) in enumerate(zip(reference, resumed, strict=True)):
        for key in ("draws", "trained", "sync", "weights", "optimizer", "scheduler", "progress"):
            _equal(a[key], b[key], f"rank {rank} {key}")
    # What the load restored, not a fresh start: 15 optimizer steps over the two runs (6
    # saved mid-epoch 1; after it, 5 in the first epoch, whose last batch closes a window, and
    # 4), Accelerate's step 5 (the first resumed batch closes a window), and the registered
    # object's 13 + 16 batches.
    state = resumed[0]["optimizer"]["state"][0]
    assert int(state["step"]) == 6 + 5 + 4
    assert resumed[0]["sync"][:2] == [True, False]
    assert resumed[0]["progress"]["batches"] == 13 + 16
    assert resumed[0]["scheduler"]["last_epoch"] == 2 * (6 + 5 + 4)
    # Each rank restored its own RNG states (random_states_<rank>.pkl): different draws.
    assert not torch.equal(resumed[0]["draws"]["torch"], resumed[1]["draws"]["torch"])

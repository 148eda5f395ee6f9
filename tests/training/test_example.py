"""End-to-end: examples/train_digits.py trains to >= 95% held-out accuracy, alone and under
torchrun (2 CPU processes, bf16 autocast, bf16 gradient compression, profiling)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch.distributed as dist
from python import python
from torchrun import torchrun

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"
MIN_ACCURACY = 0.95
RESULT_LINE = re.compile(r"^(\w+)=(\S+)$")


def results(stdout: str) -> dict[str, str]:
    """The ``key=value`` lines of the example's output, by key."""
    found: dict[str, str] = {}
    for line in stdout.splitlines():
        match = RESULT_LINE.match(line.strip())
        if match:
            found[match[1]] = match[2]
    return found


def last_line(stdout: str) -> str:
    lines = stdout.strip().splitlines()
    return lines[-1] if lines else ""


@pytest.mark.parametrize("mixed_precision", ["bf16", "fp16"])
def test_single_process(mixed_precision: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # One intra-op thread: the model is tiny, and on a busy 2-core runner two OpenMP threads
    # make training ~10x slower (same result).
    env["OMP_NUM_THREADS"] = "1"
    args = ["--cpu", "--no-progress", "--mixed-precision", mixed_precision]
    proc = python(EXAMPLE, *args, env=env, timeout=120)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert last_line(proc.stdout).startswith("final_accuracy="), proc.stdout
    accuracy = float(results(proc.stdout)["final_accuracy"])
    assert accuracy >= MIN_ACCURACY, proc.stdout
    assert "ranks_identical" not in proc.stdout  # single process: nothing to compare
    assert f"mixed_precision={mixed_precision}" in proc.stdout


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_processes_bf16_comm_hook_profiled(tmp_path: Path) -> None:
    trace_dir = tmp_path / "traces"
    proc = torchrun(
        EXAMPLE,
        "--cpu",
        "--no-progress",
        "--mixed-precision",
        "bf16",
        "--comm-hook",
        "bf16",
        "--profile-dir",
        str(trace_dir),
        nproc=2,
        timeout=240,
    )
    found = results(proc.stdout)
    assert last_line(proc.stdout).startswith("final_accuracy="), proc.stdout
    assert float(found["final_accuracy"]) >= MIN_ACCURACY, proc.stdout
    assert found["ranks_identical"] == "True", proc.stdout
    # Only the main process prints: one summary line per epoch, one result of each kind.
    assert proc.stdout.count("final_accuracy=") == 1, proc.stdout
    assert "2 process(es)" in proc.stdout, proc.stdout

    traces = sorted(p.name for p in trace_dir.iterdir())
    assert len(traces) == 2, traces
    for rank in (0, 1):
        mine = [name for name in traces if name.startswith(f"trace_rank{rank}_")]
        assert len(mine) == 1, traces
        assert (trace_dir / mine[0]).stat().st_size > 0


def test_checkpoint_dir_resumes_after_the_last_epoch(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    cmd = [str(EXAMPLE), "--no-progress", "--checkpoint-dir", str(ckpt)]
    first = python(*cmd, "--epochs", "2", timeout=300, check=True)
    assert "resumed" not in first.stdout
    second = python(*cmd, "--epochs", "3", timeout=300, check=True)
    assert f"resumed from {ckpt} after epoch 2" in second.stdout
    epochs = [line.split()[1] for line in second.stdout.splitlines() if line.startswith("epoch")]
    assert epochs == ["3"]  # only the missing epoch is trained

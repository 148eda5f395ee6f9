"""Surviving worker failure with torchrun's elastic restarts; no hangs when a peer dies."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch
from torchrun import torchrun

WORKERS = Path(__file__).parents[1] / "workers"


def test_killed_worker_is_restarted_and_resumes_exactly(tmp_path: Path) -> None:
    args = ["--steps", "30", "--every", "5", "--comm-hook", "no"]
    torchrun(
        WORKERS / "elastic.py", str(tmp_path / "clean.pt"), str(tmp_path / "c1"), *args, timeout=180
    )
    run = torchrun(
        WORKERS / "elastic.py",
        str(tmp_path / "faulty.pt"),
        str(tmp_path / "c2"),
        *args,
        "--kill-rank",
        "1",
        "--kill-at",
        "13",
        torchrun_args=["--max-restarts=1", "--monitor-interval=0.5"],
        elastic=True,
        timeout=240,
    )
    assert "resumed at step 10 (restart 1)" in run.stdout  # last checkpoint before the kill
    clean = torch.load(tmp_path / "clean.pt")
    faulty = torch.load(tmp_path / "faulty.pt")
    assert torch.equal(clean, faulty)


def run_faulty(tmp_path: Path, *fault: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Launch 2 workers without restarts and a fault injected at step 3; (result, seconds)."""
    start = time.monotonic()
    run = torchrun(
        WORKERS / "elastic.py",
        str(tmp_path / "x.pt"),
        str(tmp_path / "c"),
        "--steps",
        "30",
        "--every",
        "100",
        "--kill-at",
        "3",
        *fault,
        timeout=120,
        check=False,
    )
    return run, time.monotonic() - start


def test_peer_death_without_restart_fails_fast(tmp_path: Path) -> None:
    run, elapsed = run_faulty(tmp_path, "--kill-rank", "1", "--timeout", "5")
    assert run.returncode != 0
    assert run.stdout.count("training") == 2  # both ranks were training when rank 1 died
    assert elapsed < 60  # bounded by the 5 s process-group timeout, not a hang
    assert "local_rank: 1" in run.stderr and "Signal 9 (SIGKILL)" in run.stderr


def test_exception_in_user_code_ends_the_group_naming_the_rank(tmp_path: Path) -> None:
    run, elapsed = run_faulty(tmp_path, "--raise-rank", "1", "--timeout", "20")
    assert run.returncode != 0
    assert elapsed < 60  # rank 0 is not left waiting in a collective
    assert "user code failed on rank 1" in run.stderr
    assert "rank      : 1 (local_rank: 1)" in run.stderr  # torchrun's failure summary


UNREACHABLE = """
import time, kwplug
from kwplug import InitProcessGroupKwargs
start = time.monotonic()
try:
    kwplug.Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=3)])
except RuntimeError as exc:
    print("ERROR", exc)
print("ELAPSED", time.monotonic() - start)
"""


def test_unreachable_rendezvous_fails_within_the_timeout_naming_the_address() -> None:
    import os
    import subprocess
    import sys

    from torchrun import free_port

    port = free_port()  # nobody listens there
    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    run = subprocess.run(
        [sys.executable, "-c", UNREACHABLE],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    error = next(line for line in run.stdout.splitlines() if line.startswith("ERROR"))
    elapsed = float(run.stdout.split("ELAPSED")[-1])
    assert f"127.0.0.1:{port}" in error and "rank 1/2" in error and "gloo" in error
    assert "frame #" not in error  # one readable line, not torch's C++ stack
    assert elapsed < 30  # the 3 s timeout, not torch's 30 minutes


def test_register_for_checkpointing_needs_state_dict() -> None:
    import kwplug

    accelerator = kwplug.Accelerator(cpu=True)
    with pytest.raises(TypeError, match="state_dict"):
        accelerator.register_for_checkpointing(object())


def test_two_nodes_with_torchruns_own_rendezvous(tmp_path: Path) -> None:
    """Two torchrun agents as two "nodes" on this machine (c10d rendezvous, one process each)
    train the digits example to identical weights."""
    import os
    import subprocess
    import sys

    from torchrun import free_port

    example = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(name, None)
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=kwplug-test",
                str(example),
                "--epochs",
                "3",
                "--no-progress",
                "--comm-hook",
                "fp16",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for agent in agents:
            out, err = agent.communicate(timeout=240)
            assert agent.returncode == 0, out + err
            outputs.append(out)
    finally:
        for agent in agents:
            agent.kill()
    combined = "".join(outputs)
    assert "2 process(es) on cpu" in combined
    assert "ranks_identical=True" in combined

"""``torchrun --nnodes 1:2`` elastic with two agents on this machine: the node that does not
host the rendezvous store is killed mid-training; the survivor restarts at 1 process, resumes
from the last checkpoint (saved by 2) and finishes; its sample coverage is compared with an
uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torchrun import torchrun

from kwplug.testing.distributed import child_environment, free_port

WORKER = Path(__file__).parents[1] / "workers" / "resize_elastic.py"
N, EPOCHS = 48, 3
HOLD = (1, 4)  # the first attempt stops after epoch 1's 4th step: 2 steps after a checkpoint


def read(folder: Path, pattern: str) -> list[list[dict[str, Any]]]:
    """Every record file matching ``pattern``, by rank, as lists of JSON lines."""
    files = sorted(folder.glob(pattern))
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


def per_epoch(steps: list[dict[str, Any]]) -> dict[int, Counter[int]]:
    counts: dict[int, Counter[int]] = {}
    for step in steps:
        counts.setdefault(step["epoch"], Counter()).update(step["samples"])
    return counts


def agent(port: int, name: str, host: bool, records: Path, ckpt: Path, log: Path) -> Any:
    """One elastic agent (its own process group, so that killing it kills its worker)."""
    # Both agents must join within last_call_timeout of the first, or the first round has
    # one node (the worker would then never hold at 2 processes and the test fails, naming it).
    conf = f"is_host={str(host).lower()},join_timeout=30,last_call_timeout=8,close_timeout=5"
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2"),
        *("--nproc-per-node", "1", "--max-restarts", "3", "--monitor-interval", "0.2"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"),
        *("--rdzv-id", "resize", "--rdzv-conf", conf, "--local-addr", "127.0.0.1"),
        *(str(WORKER), str(records), str(ckpt), "--hold-at", *map(str, HOLD)),
    ]
    out = log.open("w")
    return subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT, env=child_environment(), start_new_session=True
    )


def parent(pid: int) -> int:
    """The parent process id of ``pid`` (Linux ``/proc``)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def wait_for(condition: Any, seconds: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: " + "\n".join(p.read_text()[-3000:] for p in logs))
        time.sleep(0.1)


@pytest.mark.timeout(150)  # each wait below is bounded; about 35 s on two busy cores
def test_killed_node_survivor_resumes_at_one_process(tmp_path: Path) -> None:
    clean = tmp_path / "clean"
    clean.mkdir()
    torchrun(WORKER, str(clean), str(tmp_path / "c0"), timeout=60)
    uninterrupted = [s for rank in read(clean, "*.jsonl") for s in rank if "samples" in s]

    records, ckpt = tmp_path / "records", tmp_path / "ckpt"
    records.mkdir()
    port, logs = free_port(), [tmp_path / "host.log", tmp_path / "other.log"]
    host = agent(port, "host", True, records, ckpt, logs[0])  # hosts the c10d store
    other = agent(port, "other", False, records, ckpt, logs[1])
    try:
        ready = [records / "hold_0", records / "hold_1"]
        wait_for(lambda: all(p.exists() for p in ready), 45, "no hold at 2 processes", logs)
        # Kill the node that does not host the store: its agent and its worker (torchrun
        # starts each worker in a session of its own).
        (worker,) = [
            pid for pid in map(int, (p.read_text() for p in ready)) if parent(pid) == other.pid
        ]
        os.killpg(other.pid, signal.SIGKILL)
        os.killpg(worker, signal.SIGKILL)
        other.wait(timeout=10)
        (records / "go").touch()
        host.wait(timeout=60)
    finally:
        for process in (host, other):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    output = logs[0].read_text()
    assert host.returncode == 0, output[-4000:]

    first = [s for rank in read(records, "attempt0_*.jsonl") for s in rank]
    resumed = [s for rank in read(records, "attempt1_*.jsonl") for s in rank]
    assert {s["world"] for s in first if "world" in s} == {2}
    assert resumed and {s["world"] for s in resumed if "world" in s} == {1}
    # Resumed from the last checkpoint saved by both ranks before the kill.
    saved = [tuple(s["saved"]) for s in first if "saved" in s]
    assert saved[-1] == (1, 2) and saved.count((1, 2)) == 2
    kept: list[dict[str, Any]] = []
    lost: list[dict[str, Any]] = []
    for rank in read(records, "attempt0_*.jsonl"):
        index = max(i for i, s in enumerate(rank) if s.get("saved") == [1, 2])
        kept += [s for s in rank[:index] if "samples" in s]
        lost += [s for s in rank[index:] if "samples" in s]
    # Steps trained after the last checkpoint by the killed run are replayed (expected).
    assert {(s["epoch"], s["batch"]) for s in lost} == {(1, 3), (1, 4)}
    replayed = per_epoch(lost)[1]
    assert replayed <= per_epoch([s for s in resumed if "samples" in s])[1]
    # Every sample of every epoch trained exactly once, counting from the last checkpoint, as
    # in the uninterrupted run.
    coverage = per_epoch(kept + [s for s in resumed if "samples" in s])
    assert coverage == per_epoch(uninterrupted) == {e: Counter(range(N)) for e in range(EPOCHS)}

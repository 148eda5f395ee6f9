"""The kill loop with sharded saves: a 2-process FSDP2 job saving SHARDED_STATE_DICT
checkpoints in a row is SIGKILLed (the whole job) at random instants; after every kill the
newest complete checkpoint loads (into a plain model, DCP reading the full tensors), holds one
consistent save (every tensor of both ranks' shards equal to the counter rank 0 saved) and is
at least as new as the last save that returned; the next job resumes from it (a sharded load
in 2 processes)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kwplug.checkpoint import _commit as commit
from kwplug.testing import PluginSandbox
from kwplug.testing.distributed import child_environment, free_port

pytest.importorskip("kwplug_fsdp")

WORKER = Path(__file__).parents[1] / "workers" / "kill_sharded_saver.py"
KILLS = 6


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "Z"


def acknowledged(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def check(directory: Path) -> int:
    """Load the newest checkpoint in this process; its counter, every tensor checked."""
    sys.path.insert(0, str(WORKER.parent))
    try:
        import kill_sharded_saver as worker
    finally:
        sys.path.remove(str(WORKER.parent))
    accelerator, model, optimizer, counter = worker.build([])
    accelerator.load_state(str(directory))
    for tensor in worker.tensors(model, optimizer):
        assert torch.all(tensor == float(counter.n)), counter.n
    return counter.n


def test_sharded_kill_loop_loses_nothing(tmp_path: Path) -> None:
    directory, ack = tmp_path / "ckpt", tmp_path / "ack"
    rng = random.Random(7)
    survived = unfinished = 0
    with PluginSandbox(keep_installed=["kwplug-fsdp"]) as sandbox:
        env = child_environment({**sandbox.environment(), "OMP_NUM_THREADS": "1"})
        for _ in range(KILLS):
            before = len(acknowledged(ack))
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node=2",
                "--master-addr=127.0.0.1",
                f"--master-port={free_port()}",
                str(WORKER),
                str(directory),
                str(ack),
            ]
            for pid in tmp_path.glob("pid_*"):
                pid.unlink()
            log = (tmp_path / "log").open("w")
            job = subprocess.Popen(
                cmd, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT
            )
            deadline = time.monotonic() + 180
            while len(acknowledged(ack)) <= before:  # the job is saving
                assert job.poll() is None, (tmp_path / "log").read_text()[-4000:]
                assert time.monotonic() < deadline, "no save acknowledged in 180 s"
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 1.5))
            ranks = [int(p.read_text()) for p in sorted(tmp_path.glob("pid_*"))]
            assert len(ranks) == 2
            for pid in ranks:  # both ranks at once, as a lost node; then torchrun
                os.kill(pid, signal.SIGKILL)
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
            log.close()
            for pid in ranks:  # gone before anything is read
                while Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
                    time.sleep(0.01)
            last = acknowledged(ack)[-1]
            versions = commit.versions(directory)
            unfinished += any(not commit.is_complete(v) for v in versions.values())
            assert check(directory) >= last
            survived += 1
    print(
        {
            "kills": KILLS,
            "survived": survived,
            "killed_mid_save": unfinished,
            "saves": len(acknowledged(ack)),
        }
    )
    assert survived == KILLS
    assert len(acknowledged(ack)) > KILLS  # saves made progress between the kills

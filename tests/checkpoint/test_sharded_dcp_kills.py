"""The kill loop with sharded saves: a 2-process FSDP2 job saving SHARDED_STATE_DICT
checkpoints in a row is SIGKILLed (both ranks at once) at random instants; after every kill the
newest complete checkpoint loads (into a plain model, DCP reading the full tensors), holds one
consistent save (every tensor of both ranks' shards equal to the counter rank 0 saved) and is
at least as new as the last save that returned; the next job resumes from it (a sharded load
in 2 processes).

The ranks are started as ``torchrun`` starts them, by torch's elastic agent, but forked from the
server that imported torch once (``kwplug.testing.run_torchrun``): what is killed is the two
rank processes, with SIGKILL, as before; the agent (here a thread of this process, not a third
interpreter) then sees both ranks gone and returns. Each job starts in about a second instead
of three interpreters importing torch, six times."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kwplug.checkpoint import _commit as commit
from kwplug.testing import PluginSandbox
from kwplug.testing.distributed import run_torchrun

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


def _saver_job(
    directory: Path,
    ack: Path,
    env: dict[str, str],
    folder: Path,
    ended: list[subprocess.CompletedProcess[str]],
) -> None:
    """The 2-rank saving job, until its ranks are killed (run in a thread by the test)."""
    ended.append(
        run_torchrun(
            [str(WORKER), str(directory), str(ack)], nproc=2, timeout=300, env=env, folder=folder
        )
    )


def test_sharded_kill_loop_loses_nothing(tmp_path: Path) -> None:
    directory, ack = tmp_path / "ckpt", tmp_path / "ack"
    rng = random.Random(7)
    survived = unfinished = 0
    with PluginSandbox(keep_installed=["kwplug-fsdp"]) as sandbox:
        env = {**sandbox.environment(), "OMP_NUM_THREADS": "1"}
        for number in range(KILLS):
            before = len(acknowledged(ack))
            for pid in tmp_path.glob("pid_*"):
                pid.unlink()
            ended: list[subprocess.CompletedProcess[str]] = []
            job = threading.Thread(
                target=_saver_job,
                args=(directory, ack, env, tmp_path / f"job{number}", ended),
                daemon=True,
            )
            job.start()
            deadline = time.monotonic() + 180
            while len(acknowledged(ack)) <= before:  # the job is saving
                assert job.is_alive(), ended[-1].stdout[-4000:] if ended else "no job"
                assert time.monotonic() < deadline, "no save acknowledged in 180 s"
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 1.5))
            ranks = [int(p.read_text()) for p in sorted(tmp_path.glob("pid_*"))]
            assert len(ranks) == 2
            for pid in ranks:  # both ranks at once, as a lost node; the agent then returns
                os.kill(pid, signal.SIGKILL)
            job.join(120)
            assert not job.is_alive(), "the agent did not return after its ranks were killed"
            assert ended and ended[-1].returncode != 0, ended
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

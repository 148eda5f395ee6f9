"""A rank stopped by ``SIGSTOP`` (a debugger, a frozen container) does not keep a failed job
of the forked launcher (``kwplug._process.forked``) waiting once its peer has raised (issue 18)."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from kwplug.testing import DistributedRunError, run_distributed


def stopped_peer() -> None:
    """Run in each rank: rank 1 stops itself after joining a gloo group; rank 0 then raises
    at the collective's 2 s timeout."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=2))
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(tensor)


@pytest.mark.timeout(90)
def test_a_stopped_rank_does_not_keep_the_failed_job_waiting() -> None:
    # torch's agent SIGTERMs the other ranks when one fails, then waits 30 s before SIGKILL;
    # a stopped process is not woken by SIGTERM, so the job ended 30 s after the error.
    began = time.monotonic()
    with pytest.raises(DistributedRunError, match=r"rank 0 raised RuntimeError.*Timed out"):
        run_distributed(stopped_peer, nproc=2, timeout=80)
    assert time.monotonic() - began < 30  # before: 2 s + 30 s + the start-up

"""``kwplug.launchers``: ``notebook_launcher`` and ``debug_launcher`` run a function in 2
processes through torch's elastic agent and return; their arguments are checked."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kwplug
from kwplug.launchers import debug_launcher, notebook_launcher
from kwplug.testing.distributed import child_environment, free_port

WORKER = Path(__file__).resolve().parents[1] / "workers" / "launchers.py"


def test_both_launchers_run_a_function_in_two_processes() -> None:
    command = [sys.executable, str(WORKER), str(free_port())]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=240, env=child_environment(None)
    )
    assert result.returncode == 0, result.stderr[-4000:]
    returned = json.loads(result.stdout.strip().splitlines()[-1])
    # rank -> [tag, rank, PartialState().num_processes, device, mixed precision, all-reduced
    # sum, backend]; Accelerate's MULTI_CPU device is cpu:0, and notebook_launcher's
    # mixed_precision reaches the Accelerator built inside the function (as Accelerate's).
    for tag, precision in (("debug", "no"), ("notebook", "bf16")):
        assert returned[tag] == {
            str(rank): [tag, rank, 2, "cpu:0", precision, 3.0, "gloo"] for rank in (0, 1)
        }, tag
    assert returned["single"] is None  # one process: run here, as Accelerate
    # A functools.partial (no __name__) launches too: Accelerate's test_scheduler does this.
    assert returned["partial"] == {"0": ["partial", 0, 1, "cpu", "no", 1.0, None]}


def test_signatures_are_accelerates() -> None:
    launchers = pytest.importorskip("accelerate.launchers")
    for ours, theirs in [
        (notebook_launcher, launchers.notebook_launcher),
        (debug_launcher, launchers.debug_launcher),
    ]:
        mine = inspect.signature(ours).parameters
        reference = inspect.signature(theirs).parameters
        assert [(p.name, p.default) for p in mine.values()] == [
            (p.name, p.default) for p in reference.values()
        ]
    assert kwplug.notebook_launcher is notebook_launcher


def test_bad_arguments_are_refused_before_launching() -> None:
    with pytest.raises(ValueError, match="num_processes"):
        notebook_launcher(print)
    with pytest.raises(ValueError, match="num_processes must be an int >= 1"):
        debug_launcher(print, num_processes=0)
    with pytest.raises(ValueError, match="node_rank"):
        notebook_launcher(print, num_processes=2, node_rank=1, num_nodes=1)
    with pytest.raises(ValueError, match=r"Accelerator\(mixed_precision=\.\.\.\)"):
        notebook_launcher(print, num_processes=1, mixed_precision="fp16")
    with pytest.raises(ValueError, match="mixed_precision must be 'no', 'fp16' or 'bf16'"):
        notebook_launcher(print, num_processes=2, mixed_precision="fp8")

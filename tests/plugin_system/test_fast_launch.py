"""The forked start of torchrun jobs (kwplug._process.forked) is a faithful stand-in for the
torchrun command line: each rank sees the same environment, arguments, import path, working
folder and thread count, runs its exit handlers, and the job ends with torchrun's status."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from torchrun import torchrun

from kwplug._process import forked as _forked
from kwplug.testing import run_torchrun
from kwplug.testing.distributed import child_environment

SCRIPT = Path(__file__).parents[1] / "workers" / "describe_rank.py"

#: Values that differ between any two torchrun jobs (a port, a run id, a temporary file).
PER_JOB = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


def ranks(folder: Path) -> list[dict[str, Any]]:
    return [json.loads((folder / f"rank_{r}.json").read_text()) for r in range(2)]


def test_forked_ranks_see_what_torchrun_ranks_see(tmp_path: Path) -> None:
    cli, forked = tmp_path / "cli", tmp_path / "forked"
    cli.mkdir(), forked.mkdir()
    env = {"PYTHONPATH": str(tmp_path), "KWPLUG_SOMETHING": "x y"}
    torchrun(SCRIPT, str(cli), env=env, cli=True)
    torchrun(SCRIPT, str(forked), env=env)
    for a, b in zip(ranks(cli), ranks(forked), strict=True):
        assert sorted(a["env"]) == sorted(b["env"])
        assert {k: v for k, v in a["env"].items() if k not in PER_JOB} == {
            k: v for k, v in b["env"].items() if k not in PER_JOB
        }
        assert a["env"]["KWPLUG_SOMETHING"] == "x y"
        same = ("path0", "path", "cwd", "threads", "start_method", "process", "parent", "loader")
        assert [a[k] for k in same] == [b[k] for k in same]
        # multiprocessing's main process, whose data loader workers start and return batches
        assert (a["process"], a["parent"], a["loader"]) == ("MainProcess", True, [[0, 1], [2, 3]])
        assert a["argv"] == [str(cli)] and b["argv"] == [str(forked)]
        assert a["path"][0] == b["path"][0] == str(tmp_path)  # PYTHONPATH first, as Python does
        assert a["threads"] == 1
        # nothing of kwplug came with the fork: a rank imports it afresh
        assert a["kwplug_imported"] is b["kwplug_imported"] is False
    for folder in (cli, forked):
        assert sorted(p.name for p in folder.glob("atexit_*")) == ["atexit_0", "atexit_1"]


@pytest.mark.parametrize("cli", [True, False], ids=["cli", "forked"])
def test_a_failed_rank_gives_torchruns_status_and_both_streams(tmp_path: Path, cli: bool) -> None:
    done = torchrun(SCRIPT, str(tmp_path), "1", cli=cli, check=False)
    assert done.returncode == 1  # torchrun's status, whatever the rank's (7)
    # (rank 0 may be stopped by torchrun before it prints: only the failing rank is certain)
    assert "stdout of rank 1" in done.stdout
    assert "stderr of rank 1" in done.stderr and "exitcode  : 7" in done.stderr
    assert (tmp_path / "atexit_1").exists()  # exit handlers run before the status is given


def test_run_torchrun_gives_the_output_of_every_rank(tmp_path: Path) -> None:
    done = run_torchrun([str(SCRIPT), str(tmp_path)], timeout=60)
    assert done.returncode == 0
    assert all(f"{s} of rank {r}" in done.stdout for s in ("stdout", "stderr") for r in (0, 1))
    with pytest.raises(ValueError, match="must name a script"):
        run_torchrun(["-m"])


def test_run_single_is_a_plain_process_with_its_own_status(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(
        "import os, sys\n"
        "print('RANK' in os.environ, sys.argv[1:], os.getcwd())\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    logs = tmp_path / "logs"
    logs.mkdir()
    done = _forked.run_single(
        "script",
        str(script),
        ["3"],
        env=child_environment(),
        timeout=60,
        folder=logs,
        cwd=str(tmp_path),
    )
    assert (done.returncode, done.timed_out) == (3, False)
    assert done.stdout == f"False ['3'] {tmp_path}\n"
    assert os.environ.get("RANK") is None


def test_a_job_that_sets_a_compile_config_variable_is_not_forked() -> None:
    # The server preloads torch.fx.experimental, whose config reads TORCHDYNAMO_* variables at
    # import: a forked job would see the server's values, not its own.
    base = child_environment()
    assert _forked.forkable(base)
    for name in ("TORCHDYNAMO_TRANSLATION_VALIDATION", "TORCHEXPORT_EXTENDED_DEBUG_CURRENT_LOC"):
        assert not _forked.forkable({**base, name: "1"}), name
    # torch itself sets this one in the caller's environment once anything compiles
    assert _forked.forkable({**base, "TORCHINDUCTOR_CACHE_DIR": "/tmp/elsewhere"})


def test_a_forked_job_gets_the_preloaded_modules_and_no_dynamo(tmp_path: Path) -> None:
    # What the server shares: torch's symbolic-shape machinery; never torch._dynamo, whose
    # import before init_process_group changes how gloo's groups end (see forked._PRELOAD).
    script = tmp_path / "modules.py"
    script.write_text(
        "import sys\n"
        "print('symbolic', 'torch.fx.experimental.symbolic_shapes' in sys.modules)\n"
        "print('dynamo', 'torch._dynamo' in sys.modules)\n"
    )
    out = run_torchrun([str(script)], nproc=1, timeout=120).stdout
    assert "symbolic True" in out and "dynamo False" in out, out

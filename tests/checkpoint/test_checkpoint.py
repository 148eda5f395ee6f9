"""save_state/load_state: exact resume in a new process, and crash safety."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from python import python
from torchrun import torchrun

import kwplug
from kwplug import checkpoint
from kwplug.checkpoint import _commit as commit

WORKER = Path(__file__).parents[1] / "workers" / "resume.py"


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # one thread: fast on a busy 2-core box
    result = python(WORKER, *args, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if check and result.returncode != 0:
        raise AssertionError(result.stdout + result.stderr)
    return result


@pytest.mark.parametrize("precision", ["no", "fp16"])
def test_resume_in_a_new_process_is_bitwise_exact(tmp_path: Path, precision: str) -> None:
    # 16 batches per epoch: save mid-epoch (step 21) and finish in the third epoch.
    ckpt = tmp_path / "ckpt"
    run(str(tmp_path / "full.pt"), "--steps", "40", "--mixed-precision", precision)
    run(
        str(tmp_path / "first.pt"),
        "--steps",
        "21",
        "--save-at",
        "21",
        "--ckpt",
        str(ckpt),
        "--mixed-precision",
        precision,
    )
    assert checkpoint.is_complete(ckpt)
    run(
        str(tmp_path / "resumed.pt"),
        "--steps",
        "40",
        "--resume",
        str(ckpt),
        "--start-step",
        "21",
        "--mixed-precision",
        precision,
    )
    full = torch.load(tmp_path / "full.pt")
    resumed = torch.load(tmp_path / "resumed.pt")
    assert torch.equal(full, resumed)
    assert not torch.equal(full, torch.load(tmp_path / "first.pt"))


@pytest.mark.parametrize(
    "options",
    [
        ["--comm-hook", "power_sgd"],
        ["--comm-hook", "batched_power_sgd"],
        ["--comm-hook", "power_sgd", "--comm-wrapper", "fp16", "--gradient-as-bucket-view"],
        ["--comm-hook", "power_sgd_inplace"],
        ["--comm-hook", "power_sgd_inplace", "--gradient-as-bucket-view"],
    ],
    ids=[
        "power_sgd",
        "batched_power_sgd",
        "power_sgd-fp16-bucket_view",
        "power_sgd_inplace",
        "power_sgd_inplace-bucket_view",
    ],
)
def test_ddp_power_sgd_resume_is_bitwise_exact(tmp_path: Path, options: list[str]) -> None:
    # 2 processes, PowerSGD compressing from step 2 on. The resumed DDP runs its first step
    # with its initial bucket layout while the saved error feedback and P/Q memories come
    # from the rebuilt layout; kwplug's canonical bucket view makes the two agree. The
    # uninterrupted run saves at step 10 on its way to step 24 (saving does not perturb it).
    ckpt = tmp_path / "ckpt"
    torchrun(
        WORKER,
        str(tmp_path / "full.pt"),
        *("--steps", "24", "--save-at", "10", "--ckpt", str(ckpt), *options),
    )
    assert checkpoint.is_complete(ckpt)
    torchrun(
        WORKER,
        str(tmp_path / "resumed.pt"),
        *("--steps", "24", "--resume", str(ckpt), "--start-step", "10", *options),
    )
    assert torch.equal(torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt"))


def assert_resume_is_bitwise(
    tmp_path: Path, hook: str, *, steps: str, save_at: str, options: Sequence[str] = ()
) -> None:
    """2 processes, several DDP buckets: a run saving after ``save_at`` steps and a run
    resumed from that checkpoint end with bitwise equal weights."""
    ckpt = tmp_path / "ckpt"
    common = ["--comm-hook", hook, "--model", "buckets", "--bucket-cap-mb", "0.001", *options]
    torchrun(
        WORKER,
        str(tmp_path / "full.pt"),
        *("--steps", steps, "--save-at", save_at, "--ckpt", str(ckpt), *common),
    )
    torchrun(
        WORKER,
        str(tmp_path / "resumed.pt"),
        *("--steps", steps, "--resume", str(ckpt), "--start-step", save_at, *common),
    )
    assert torch.equal(torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt"))


@pytest.mark.parametrize("hook", ["power_sgd", "batched_power_sgd"])
def test_ddp_power_sgd_resume_with_several_buckets_is_bitwise_exact(
    tmp_path: Path, hook: str
) -> None:
    # Three rebuilt buckets, one of them a single weight that lies 2,600 bytes into the
    # resumed DDP's initial single bucket. Its tile must reach PowerSGD in a buffer of its
    # own, as its bucket did in the saving run: CPU BLAS rounds a matmul on a view at another
    # alignment differently (a zero-copy view there diverged at the first resumed step).
    # The same holds for checkpoints with sorted keys (kwplug before PowerSGD followed DDP's
    # order), whose tiles lie back to back in the initial bucket.
    assert_resume_is_bitwise(tmp_path, hook, steps="16", save_at="6")


@pytest.mark.parametrize(
    ("hook", "save_at", "options"),
    [
        ("power_sgd", "2", []),
        ("batched_power_sgd", "2", []),
        ("power_sgd", "5", ["--no-error-feedback", "--no-warm-start"]),
        ("batched_power_sgd", "5", ["--no-error-feedback", "--no-warm-start"]),
    ],
    ids=["power_sgd", "batched_power_sgd", "power_sgd-stateless", "batched_power_sgd-stateless"],
)
def test_ddp_power_sgd_resume_before_any_bucket_key_is_bitwise_exact(
    tmp_path: Path, hook: str, save_at: str, options: list[str]
) -> None:
    # The checkpoint holds no PowerSGD bucket key: saved after step 2 with
    # start_powerSGD_iter=2 (the resumed run's first step is the first compressed one), or
    # with neither error feedback nor warm start (the state never keeps a key). The saved
    # canonical layout (DDP's rebuilt buckets, in DDP's order) still cuts the resumed DDP's
    # initial single bucket as the saving run's rebuilt buckets were cut.
    assert_resume_is_bitwise(tmp_path, hook, steps="12", save_at=save_at, options=options)


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run(str(tmp_path / "a.pt"), "--steps", "5", "--save-at", "5", "--ckpt", str(ckpt))
    first = checkpoint.resolve_checkpoint(ckpt)
    assert first is not None
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    crashed = run(
        str(tmp_path / "b.pt"),
        "--steps",
        "9",
        "--save-at",
        "9",
        "--ckpt",
        str(ckpt),
        "--crash-in-save",
        check=False,
    )
    assert crashed.returncode == 17
    unfinished = set(commit.versions(ckpt).values()) - {first}
    assert len(unfinished) == 1  # the half-committed new version, without a marker
    assert checkpoint.resolve_checkpoint(ckpt) == first
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    # Resuming from the surviving checkpoint still works, and a new save replaces both.
    run(
        str(tmp_path / "c.pt"),
        "--steps",
        "8",
        "--resume",
        str(ckpt),
        "--start-step",
        "5",
        "--save-at",
        "8",
        "--ckpt",
        str(ckpt),
    )
    (newest,) = commit.versions(ckpt).values()
    assert checkpoint.resolve_checkpoint(ckpt) == newest not in unfinished | {first}


def test_load_errors(tmp_path: Path) -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    with pytest.raises(FileNotFoundError, match="no complete kwplug checkpoint"):
        accelerator.load_state(tmp_path / "nothing")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "model_0.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="COMPLETE"):
        accelerator.load_state(tmp_path / "half")


def test_data_loader_position_round_trip() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    data = torch.utils.data.TensorDataset(torch.arange(20))
    loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=3, shuffle=True))
    first_epoch = [b[0].tolist() for b in loader]
    it = iter(loader)
    seen = [next(it)[0].tolist() for _ in range(4)]
    state = loader.state_dict()
    assert (state["epoch"], state["batches_yielded"]) == (1, 4)
    rest = [b[0].tolist() for b in it]
    other = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=3, shuffle=True))
    other.load_state_dict(state)
    assert [b[0].tolist() for b in other] == rest
    assert seen + rest != first_epoch  # a new shuffle each epoch


def test_empty_checkpoint_path_is_a_clear_error() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    with pytest.raises(ValueError, match="empty path"):
        accelerator.load_state("")
    with pytest.raises(ValueError, match="empty path"):
        accelerator.save_state("")

"""Files kwplug writes follow the umask, as ``MANIFEST.json`` always did (issue 30, item 6):
safetensors' ``save_file`` creates its files ``0600`` whatever the umask, so a teammate's job
reading a shared checkpoint failed with ``PermissionError``."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kwplug
from kwplug import checkpoint
from kwplug._process.umask import current_umask, file_mode


@pytest.fixture(params=[0o022, 0o002, 0o077], ids=["022", "002", "077"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _modes(folder: Path) -> dict[str, int]:
    return {
        p.name: stat.S_IMODE(p.stat().st_mode)
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".")
    }


def test_current_umask_is_read_without_changing_it(umask: int) -> None:
    assert current_umask() == umask
    assert os.umask(umask) == umask  # unchanged by the read
    assert file_mode() == 0o666 & ~umask


def test_save_state_files_follow_the_umask(tmp_path: Path, umask: int) -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    accelerator.save_state(tmp_path / "ckpt")
    version = checkpoint.resolve_checkpoint(tmp_path / "ckpt")
    assert version is not None
    modes = _modes(version)
    assert "MANIFEST.json" in modes and any(n.endswith(".safetensors") for n in modes)
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)
    # and the checkpoint still loads
    accelerator.load_state(tmp_path / "ckpt")


@pytest.mark.parametrize("max_shard_size", ["10GB", 200], ids=["one-file", "sharded"])
def test_save_model_files_follow_the_umask(
    tmp_path: Path, umask: int, max_shard_size: str | int
) -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))
    accelerator.save_model(model, tmp_path / "out", max_shard_size=max_shard_size)
    modes = _modes(tmp_path / "out")
    assert sum(n.endswith(".safetensors") for n in modes) == (1 if max_shard_size == "10GB" else 2)
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)

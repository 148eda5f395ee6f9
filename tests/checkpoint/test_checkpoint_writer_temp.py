"""A save killed while safetensors writes a state file leaves that writer's temporary file
(``.tmpXXXXXX``, renamed into place when done) in the unfinished version. The next run must
resume and save as after any other kill: with automatic naming it saves into the killed save's
``checkpoint_<n>`` again (it was refused as "already exists"), and in an explicit folder the
unfinished version is deleted (it was kept forever, one model file of disk per kill)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import kwplug
from kwplug.checkpoint import _layout as layout
from kwplug.utils import ProjectConfiguration

# 8 Mi float32 parameters: the model file takes long enough to write that the kill lands in it.
SAVER = """
import sys, torch, kwplug
from kwplug.utils import ProjectConfiguration
where, automatic = sys.argv[1], sys.argv[2] == "auto"
config = ProjectConfiguration(project_dir=where, automatic_checkpoint_naming=automatic)
accelerator = kwplug.Accelerator(cpu=True, project_config=config)
model = accelerator.prepare(torch.nn.Linear(4096, 2048, bias=False))
with torch.no_grad():
    model.weight.fill_(1.0)
accelerator.save_state() if automatic else accelerator.save_state(where)
print("first saved", flush=True)
with torch.no_grad():
    model.weight.fill_(2.0)
while True:
    accelerator.save_state() if automatic else accelerator.save_state(where)
"""


def _kill_while_writing(root: Path, mode: str) -> Path:
    """Run the saver (in a fresh folder under ``root``) until safetensors' temporary file of a
    later save exists, and SIGKILL it there; returns the temporary file. A kill that lands
    just after the rename (the file gone) is tried again in another folder."""
    for attempt in range(10):
        temp = _one_kill(root / f"attempt_{attempt}", mode)
        if temp is not None:
            return temp
    raise AssertionError("10 kills in a row landed after safetensors renamed its file")


def _one_kill(where: Path, mode: str) -> Path | None:
    saver = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(where), mode],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert saver.stdout is not None
        assert saver.stdout.readline().strip() == "first saved"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            # The first save returned before its line was printed: any temporary file now
            # belongs to a later save.
            temps = [p for p in where.rglob(".tmp*") if layout.is_writer_temp(p.name)]
            if temps:
                saver.send_signal(signal.SIGKILL)
                saver.wait(timeout=30)
                return temps[0] if temps[0].exists() else None
            time.sleep(0.0005)
        raise AssertionError("no safetensors temporary file appeared in 60 s")
    finally:
        if saver.poll() is None:
            saver.kill()
            saver.wait(timeout=30)


def _resumed(where: Path, automatic: bool) -> tuple[kwplug.Accelerator, torch.nn.Module]:
    config = ProjectConfiguration(project_dir=str(where), automatic_checkpoint_naming=automatic)
    accelerator = kwplug.Accelerator(cpu=True, project_config=config)
    model = accelerator.prepare(torch.nn.Linear(4096, 2048, bias=False))
    return accelerator, model


def test_automatic_naming_saves_into_the_killed_saves_folder_again(tmp_path: Path) -> None:
    temp = _kill_while_writing(tmp_path, "auto")
    killed = temp.parent.parent  # checkpoints/checkpoint_<n>/kwplug-00000001/.tmpXXXXXX
    assert killed.name.startswith("checkpoint_")
    project = killed.parent.parent
    accelerator, model = _resumed(project, automatic=True)
    accelerator.load_state()  # the newest complete checkpoint
    assert model.weight.detach()[0, 0].item() in (1.0, 2.0)
    saved = accelerator.save_state()  # refused as "already exists" before the fix
    assert saved == killed
    assert not temp.exists()
    assert sorted(p.name for p in killed.iterdir() if p.is_dir()) == ["kwplug-00000002"]
    accelerator, model = _resumed(project, automatic=True)
    accelerator.load_state()
    assert accelerator.save_iteration == int(killed.name.split("_")[1]) + 1


def test_an_explicit_folder_deletes_the_killed_version(tmp_path: Path) -> None:
    temp = _kill_while_writing(tmp_path, "dir")
    unfinished = temp.parent
    assert not (unfinished / layout.MARKER).exists()
    folder = unfinished.parent
    accelerator, model = _resumed(tmp_path, automatic=False)
    accelerator.load_state(folder)
    weight = model.weight.detach()
    assert weight[0, 0].item() in (1.0, 2.0) and torch.equal(weight, weight[0, 0].expand_as(weight))
    accelerator.save_state(folder)
    assert not unfinished.exists()  # kept forever before the fix
    versions = sorted(p.name for p in folder.iterdir() if p.is_dir())
    assert len(versions) == 1 and (folder / versions[0] / layout.MARKER).is_file()

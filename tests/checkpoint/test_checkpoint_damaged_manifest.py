"""A damaged manifest, a listed FIFO or link, a tensor of another dtype: each refused with one
``CheckpointError`` naming the file (issue 18, item 5)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import kwplug
from kwplug import checkpoint
from kwplug.checkpoint import CheckpointError
from kwplug.checkpoint import _checksum as checksum
from kwplug.checkpoint import _commit as commit
from kwplug.checkpoint import _layout as layout


def _saved(tmp_path: Path, dtype: torch.dtype = torch.float32) -> tuple[kwplug.Accelerator, Path]:
    accelerator = kwplug.Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2).to(dtype)
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.save_state(tmp_path / "ckpt")
    version = checkpoint.resolve_checkpoint(tmp_path / "ckpt")
    assert version is not None
    return accelerator, version


def _rewrite(version: Path, edit: object) -> None:
    body = json.loads((version / layout.MANIFEST).read_text())
    text = edit(body) if callable(edit) else edit
    (version / layout.MANIFEST).write_text(text if isinstance(text, str) else json.dumps(text))


def _size_infinity(body: dict) -> str:
    body["files"]["model_0.safetensors"][0] = float("inf")
    return json.dumps(body)  # Infinity: valid for Python's json


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (_size_infinity, "the record of 'model_0.safetensors' is"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        (lambda body: {**body, "files": list(body["files"])}, "'files' is a JSON list"),
        ("[1, 2]", "a JSON list, not an object"),
        (
            lambda body: {**body, "files": {**body["files"], "rank_0.safetensors": [True, "x"]}},
            "the record of 'rank_0.safetensors'",
        ),
    ],
)
def test_a_damaged_manifest_is_one_checkpoint_error(
    tmp_path: Path, damage: object, expected: str
) -> None:
    accelerator, version = _saved(tmp_path)
    _rewrite(version, damage)
    with pytest.raises(CheckpointError, match=expected) as info:
        accelerator.load_state(tmp_path / "ckpt")
    assert info.value.file == str(version / layout.MANIFEST)
    assert commit.listed(version) == set()  # the prune's reader says "none" too


@pytest.mark.parametrize("name", ["../../../../etc/passwd", "/etc/passwd", "a\x00b", ".", "x/../y"])
def test_a_listed_name_outside_the_folder_is_named_so(tmp_path: Path, name: str) -> None:
    # Issue 18 re-check: these were refused, but as "missing (listed in the manifest)" for a
    # file that exists; the manifest itself is what is wrong.
    accelerator, version = _saved(tmp_path)
    body = json.loads((version / layout.MANIFEST).read_text())
    body["files"][name] = [0, checksum.of_bytes(b"")]
    (version / layout.MANIFEST).write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match="not a file name inside the checkpoint") as info:
        accelerator.load_state(tmp_path / "ckpt")
    assert info.value.file == str(version / layout.MANIFEST)
    assert "missing" not in str(info.value)


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_listed_fifo_or_link_is_refused(tmp_path: Path, kind: str) -> None:
    accelerator, version = _saved(tmp_path)
    planted = version / "notes.txt"  # a name a save hook could have written
    if kind == "fifo":
        os.mkfifo(planted)
    else:
        planted.symlink_to("/etc")
    body = json.loads((version / layout.MANIFEST).read_text())
    body["files"]["notes.txt"] = [0, checksum.of_bytes(b"")]
    (version / layout.MANIFEST).write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match="not a regular file") as info:
        accelerator.load_state(tmp_path / "ckpt")
    assert info.value.file == str(planted)


def test_a_tensor_of_another_dtype_is_refused(tmp_path: Path) -> None:
    _saved(tmp_path, torch.bfloat16)
    accelerator = kwplug.Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = model.weight.detach().clone()
    with pytest.raises(
        CheckpointError, match=r"'weight' is torch.bfloat16, the model's is torch.float32"
    ):
        accelerator.load_state(tmp_path / "ckpt")
    assert torch.equal(model.weight, before)

"""Manifest checksums (issue 31 goal 1): xxh3-128 per file in format 3, computed on save from
the bytes written (no re-read of the tensors) and on load in the read that decodes; a
format-2 manifest (sha256) still loads; an unknown algorithm is refused by name; a flipped
byte is refused before anything changes."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import kwplug
from kwplug import checkpoint
from kwplug.checkpoint import CheckpointError
from kwplug.checkpoint import _layout as layout


def _setup() -> tuple[kwplug.Accelerator, Any, Any]:
    torch.manual_seed(0)
    accelerator = kwplug.Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.Linear(96, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(4, 96)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return accelerator, model, optimizer


def _version(directory: Path) -> Path:
    version = checkpoint.resolve_checkpoint(directory)
    assert version is not None
    return version


def _snapshot(model: Any, optimizer: Any) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = [
        v.clone()
        for s in optimizer.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]
    return weights, state


def _unchanged(model: Any, optimizer: Any, snapshot: Any) -> None:
    weights, state = _snapshot(model, optimizer)
    for key, value in snapshot[0].items():
        assert torch.equal(weights[key], value), key
    assert len(state) == len(snapshot[1])
    assert all(torch.equal(a, b) for a, b in zip(state, snapshot[1], strict=True))


def test_the_manifest_names_xxh3_128_of_each_file_as_written(tmp_path: Path) -> None:
    accelerator, *_ = _setup()
    accelerator.save_state(tmp_path / "ckpt")
    version = _version(tmp_path / "ckpt")
    body = json.loads((version / layout.MANIFEST).read_text())
    assert body["format"] == "kwplug-checkpoint-3"
    assert {"model_0.safetensors", "optimizer_0.safetensors", "rank_0.safetensors"} <= set(
        body["files"]
    )
    for name, (size, digest) in body["files"].items():
        data = (version / name).read_bytes()
        assert re.fullmatch(r"xxh3-128:[0-9a-f]{32}", digest), digest
        assert (size, digest) == (len(data), f"xxh3-128:{xxhash.xxh3_128_hexdigest(data)}")


def test_save_never_reads_the_tensors_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The checksum is of the header read back and the tensors' memory: a save reads a few
    # kilobytes of its state files, not their megabytes.
    accelerator, *_ = _setup()
    read: list[int] = []
    real_pread, real_preadv = os.pread, os.preadv

    def pread(fd: int, count: int, offset: int) -> bytes:
        data = real_pread(fd, count, offset)
        read.append(len(data))
        return data

    def preadv(fd: int, buffers: list[Any], offset: int) -> int:
        count = real_preadv(fd, buffers, offset)
        read.append(count)
        return count

    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "preadv", preadv)
    accelerator.save_state(tmp_path / "ckpt")
    monkeypatch.undo()
    version = _version(tmp_path / "ckpt")
    written = sum(p.stat().st_size for p in version.glob("*.safetensors"))
    assert written > 100_000 and sum(read) < 16_384
    accelerator.load_state(tmp_path / "ckpt")  # and the checksums recorded are the files'


@pytest.mark.parametrize("name", ["model_0.safetensors", "optimizer_0.safetensors"])
def test_a_flipped_byte_is_refused_before_anything_changes(tmp_path: Path, name: str) -> None:
    accelerator, model, optimizer = _setup()
    accelerator.save_state(tmp_path / "ckpt")
    target = _version(tmp_path / "ckpt") / name
    data = bytearray(target.read_bytes())
    data[len(data) - 1000] ^= 0x01  # one bit of one tensor's bytes
    target.write_bytes(bytes(data))
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(-1.0)  # differ from the checkpoint: a load would show
    for state in optimizer.optimizer.state.values():
        state["exp_avg"].add_(1.0)
    before = _snapshot(model, optimizer)
    with pytest.raises(
        CheckpointError, match=r"does not match its checksum \(xxh3-128\)"
    ) as caught:
        accelerator.load_state(tmp_path / "ckpt")
    assert caught.value.file == str(target)
    _unchanged(model, optimizer, before)


def _to_format_2(version: Path) -> dict[str, Any]:
    # The manifest as kwplug 0.x wrote it before issue 31 (format 2: bare sha256 digests);
    # the state files themselves did not change between the formats.
    path = version / layout.MANIFEST
    body = json.loads(path.read_text())
    body["format"] = "kwplug-checkpoint-2"
    body["files"] = {
        name: [size, hashlib.sha256((version / name).read_bytes()).hexdigest()]
        for name, (size, _) in body["files"].items()
    }
    path.write_text(json.dumps(body, indent=1))
    return body


def test_a_format_2_checkpoint_with_sha256_loads(tmp_path: Path) -> None:
    accelerator, model, optimizer = _setup()
    accelerator.save_state(tmp_path / "ckpt")
    saved = _snapshot(model, optimizer)
    body = _to_format_2(_version(tmp_path / "ckpt"))
    assert all(re.fullmatch(r"[0-9a-f]{64}", d) for _, d in body["files"].values())
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    for state in optimizer.optimizer.state.values():
        state["exp_avg"].zero_()
    accelerator.load_state(tmp_path / "ckpt")
    _unchanged(model, optimizer, saved)
    # A later save writes format 3 beside it, and that loads too.
    accelerator.save_state(tmp_path / "ckpt")
    newest = json.loads((_version(tmp_path / "ckpt") / layout.MANIFEST).read_text())
    assert newest["format"] == "kwplug-checkpoint-3"
    accelerator.load_state(tmp_path / "ckpt")
    _unchanged(model, optimizer, saved)


def test_a_format_2_checkpoint_with_a_flipped_byte_is_refused(tmp_path: Path) -> None:
    accelerator, model, optimizer = _setup()
    accelerator.save_state(tmp_path / "ckpt")
    version = _version(tmp_path / "ckpt")
    _to_format_2(version)
    target = version / "model_0.safetensors"
    data = bytearray(target.read_bytes())
    data[-5] ^= 0x80
    target.write_bytes(bytes(data))
    before = _snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=r"does not match its checksum \(sha256\)"):
        accelerator.load_state(tmp_path / "ckpt")
    _unchanged(model, optimizer, before)


@pytest.mark.parametrize(
    ("digest", "message"),
    [
        ("md5:" + "0" * 32, "names the checksum algorithm 'md5'; kwplug knows sha256, xxh3-128"),
        ("xxh3-128:" + "0" * 31, "is not a xxh3-128 checksum"),
        ("0" * 32, "is not a checksum '<algorithm>:<hex digest>'"),
    ],
)
def test_an_unknown_or_malformed_checksum_is_refused_by_name(
    tmp_path: Path, digest: str, message: str
) -> None:
    accelerator, model, optimizer = _setup()
    accelerator.save_state(tmp_path / "ckpt")
    path = _version(tmp_path / "ckpt") / layout.MANIFEST
    body = json.loads(path.read_text())
    body["files"]["model_0.safetensors"][1] = digest
    path.write_text(json.dumps(body))
    before = _snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=re.escape(message)) as caught:
        accelerator.load_state(tmp_path / "ckpt")
    assert "model_0.safetensors" in str(caught.value)
    _unchanged(model, optimizer, before)

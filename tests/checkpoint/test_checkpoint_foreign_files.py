"""A pickle planted in a checkpoint is refused with one clear error: the file, what it looks
like, no ``UnicodeDecodeError`` (issue 12, review follow-up)."""

from __future__ import annotations

import io
import json
import os
import pickle
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import kwplug
from kwplug import checkpoint
from kwplug.checkpoint import CheckpointError
from kwplug.checkpoint import _checksum as checksum
from kwplug.checkpoint import _codec as codec
from kwplug.checkpoint import _layout as layout
from kwplug.checkpoint import _reader as reader


def _torch_save(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _saved(tmp_path: Path) -> tuple[kwplug.Accelerator, Path]:
    accelerator = kwplug.Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.save_state(tmp_path / "ckpt")
    version = checkpoint.resolve_checkpoint(tmp_path / "ckpt")
    assert version is not None
    return accelerator, version


def _plant(version: Path, name: str, data: bytes) -> None:
    (version / name).write_bytes(data)
    if name != layout.MANIFEST:  # as an attacker would, so that the sha256 check passes
        body = json.loads((version / layout.MANIFEST).read_text())
        body["files"][name] = [len(data), checksum.of_bytes(data)]
        (version / layout.MANIFEST).write_text(json.dumps(body))


@pytest.mark.parametrize("name", ["model_0.safetensors", "rank_0.safetensors", layout.MANIFEST])
@pytest.mark.parametrize(
    ("dump", "looks_like"),
    [(pickle.dumps, "looks like a pickle"), (_torch_save, "looks like a torch.save zip archive")],
    ids=["pickle", "torch.save"],
)
def test_planted_pickle_is_named_without_decode_noise(
    tmp_path: Path, name: str, dump: Callable[[object], bytes], looks_like: str
) -> None:
    accelerator, version = _saved(tmp_path)
    _plant(version, name, dump({"weight": [1.0, 2.0]}))
    with pytest.raises(CheckpointError) as info:
        accelerator.load_state(tmp_path / "ckpt")
    error = info.value
    message = str(error)
    kind = "JSON manifest" if name == layout.MANIFEST else "state file"
    assert message.startswith(f"{version / name} is not a {kind} kwplug wrote"), message
    assert looks_like in message and "; kwplug never loads pickles" in message, message
    assert error.file == str(version / name)
    assert error.__cause__ is None and (error.__suppress_context__ or error.__context__ is None)
    shown = "".join(traceback.format_exception(error))
    assert "UnicodeDecodeError" not in shown and "During handling" not in shown, shown


@pytest.mark.parametrize("name", ["model_0.safetensors", layout.MANIFEST])
def test_other_binary_is_refused_without_decode_noise(tmp_path: Path, name: str) -> None:
    # Eight header-size bytes, then bytes that are not UTF-8: neither pickle nor zip.
    accelerator, version = _saved(tmp_path)
    _plant(version, name, (4).to_bytes(8, "little") + b"\xff\xfe\xfd\xfc")
    with pytest.raises(CheckpointError, match="not UTF-8 text") as info:
        accelerator.load_state(tmp_path / "ckpt")
    shown = "".join(traceback.format_exception(info.value))
    assert "UnicodeDecodeError" not in shown and "During handling" not in shown, shown


def test_too_short_state_file_says_so(tmp_path: Path) -> None:
    accelerator, version = _saved(tmp_path)
    _plant(version, "model_0.safetensors", b"abc")
    with pytest.raises(CheckpointError, match="3 bytes, too few for a safetensors header"):
        accelerator.load_state(tmp_path / "ckpt")


def test_state_file_whose_header_length_starts_with_0x80_loads(tmp_path: Path) -> None:
    # A safetensors header length of 128 mod 256 makes the file's first byte 0x80, the
    # pickle PROTO opcode; such a file (found by a user: an AdamW state) must still load.
    path = tmp_path / "optimizer_0.safetensors"
    for width in range(300):
        state = {"note": "x" * width, "t": torch.arange(3.0)}
        record = codec.write_state(path, state)
        data = path.read_bytes()
        if data[0] == 0x80:
            break
    else:
        pytest.fail("no padding width gave a header length of 128 mod 256")
    assert codec.foreign_format(data, len(data)) is None
    loaded, _ = reader.read_state(path, record)
    assert loaded["note"] == state["note"] and torch.equal(loaded["t"], state["t"])
    assert codec.foreign_format(pickle.dumps(state), len(pickle.dumps(state))) is not None


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "file"])
def test_an_entry_planted_at_the_next_version_name_is_skipped(tmp_path: Path, kind: str) -> None:
    # Issue 18: a link or file at kwplug-<n+1> made every later save fail on it.
    accelerator, version = _saved(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = version.with_name(layout.version_name(2))
    if kind == "file":
        planted.write_bytes(b"x")
    else:
        planted.symlink_to(outside if kind == "symlink" else tmp_path / "missing")
    for _ in range(2):
        accelerator.save_state(tmp_path / "ckpt")
    newest = checkpoint.resolve_checkpoint(tmp_path / "ckpt")
    assert newest is not None and newest.name == layout.version_name(4)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        layout.LOCK,
        layout.version_name(2),
        layout.version_name(4),
    ]
    assert os.listdir(outside) == []  # never followed, never written through
    assert planted.is_symlink() == (kind != "file")
    accelerator.load_state(tmp_path / "ckpt")

"""Checkpoints keep foreign files, run no code, verify before loading, refuse a second saver
(issue 12, items 1, 2, 4, 5)."""

from __future__ import annotations

import errno
import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import kwplug
import kwplug.attached_state
from kwplug import checkpoint
from kwplug.checkpoint import CheckpointError
from kwplug.checkpoint import _checksum as checksum
from kwplug.checkpoint import _codec as codec
from kwplug.checkpoint import _layout as layout
from kwplug.checkpoint import _manifest as manifest


class Counter:
    """A registered object: ``state_dict``/``load_state_dict``."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


def setup(optimizer: type[torch.optim.Optimizer] = torch.optim.Adam, width: int = 3) -> Any:
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="fp16")
    model = torch.nn.Linear(4, width)
    optimizer_ = optimizer(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2, shuffle=True
    )
    model, optimizer_, loader = accelerator.prepare(model, optimizer_, loader)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    for (x,) in loader:
        accelerator.backward(model(x).float().pow(2).mean())
        optimizer_.step()
        optimizer_.zero_grad()
        break
    return accelerator, model, optimizer_, counter


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def test_save_keeps_foreign_files_and_folders(tmp_path: Path, monkeypatch: Any) -> None:
    (tmp_path / "train.py").write_text("print('my training script')\n")
    (tmp_path / "runs" / "tb").mkdir(parents=True)
    (tmp_path / "runs" / "tb" / "events.out").write_bytes(b"\x00tensorboard")
    (tmp_path / "model_0.pt").write_bytes(b"an exported model of mine")  # kwplug-ish names
    (tmp_path / "COMPLETE").write_text("mine")
    (tmp_path / "kwplug-00000001").mkdir()  # a folder under kwplug's name, but not kwplug's
    (tmp_path / "kwplug-00000001" / "notes.txt").write_text("keep me")
    before = snapshot(tmp_path)
    accelerator, *_ = setup()
    monkeypatch.chdir(tmp_path)
    for _ in range(3):
        accelerator.save_state(".")  # the case that deleted the training script
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before
    assert checkpoint.resolve_checkpoint(tmp_path) == tmp_path / "kwplug-00000004"
    accelerator.load_state(".")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        accelerator.save_state(tmp_path / "a-file")
    assert (tmp_path / "a-file").read_text() == "x"


class Evil:
    """Unpickling it creates a marker file: the proof that a load ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def genuine(tmp_path: Path) -> tuple[Any, Path]:
    accelerator, *_ = setup()
    accelerator.save_state(tmp_path / "ckpt")
    version = checkpoint.resolve_checkpoint(tmp_path / "ckpt")
    assert version is not None
    return accelerator, version


def rewrite_manifest(version: Path, name: str) -> None:
    # An attacker who can replace a file can rewrite the manifest too.
    body = json.loads((version / layout.MANIFEST).read_text())
    data = (version / name).read_bytes()
    body["files"][name] = [len(data), checksum.of_bytes(data)]
    (version / layout.MANIFEST).write_text(json.dumps(body))


def test_malicious_files_are_refused_and_never_run(tmp_path: Path) -> None:
    accelerator, version = genuine(tmp_path)
    names = sorted(p.name for p in version.iterdir() if p.suffix == ".safetensors")
    assert len(names) == 5  # model, optimizer, scaler, custom, rank
    originals = {name: (version / name).read_bytes() for name in names}
    manifest_bytes = (version / layout.MANIFEST).read_bytes()
    marker = tmp_path / "pwned"
    tried = 0
    for name in names:
        for fix_manifest in (False, True):
            for dump in (pickle.dumps, lambda obj: _torch_save_bytes(obj, tmp_path)):
                (version / name).write_bytes(dump(Evil(marker)))
                if fix_manifest:
                    rewrite_manifest(version, name)
                with pytest.raises(CheckpointError, match=name):
                    accelerator.load_state(tmp_path / "ckpt")
                tried += 1
                assert not marker.exists()
                (version / name).write_bytes(originals[name])
                (version / layout.MANIFEST).write_bytes(manifest_bytes)
    assert tried == 4 * len(names)
    accelerator.load_state(tmp_path / "ckpt")  # the genuine files still load


def _torch_save_bytes(obj: Any, tmp_path: Path) -> bytes:
    path = tmp_path / "evil.pt"
    torch.save({"state": obj}, path)
    return path.read_bytes()


def test_genuine_checkpoint_loads_with_torch_force_weights_only(tmp_path: Path) -> None:
    _, version = genuine(tmp_path)
    code = (
        "import sys, torch, kwplug\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from test_checkpoint_safety import setup\n"
        "accelerator, *_ = setup()\n"
        "accelerator.load_state(sys.argv[1])\n"
        "print('loaded')\n"
    )
    env = {**os.environ, "TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(version.parent), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0 and "loaded" in result.stdout, result.stderr


def unchanged(model: torch.nn.Module, before: torch.Tensor) -> bool:
    return torch.equal(model.weight.detach(), before)


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("truncate", r"bytes, the manifest says \d+ \(truncated\?\)"),
        ("grow", r"bytes, the manifest says \d+ \(replaced or appended to\?\)"),
        ("corrupt", "does not match its checksum"),
        ("missing", "is missing"),
        ("fifo", "not a regular file"),
        ("foreign", "not listed in the manifest"),
        ("manifest", "not a kwplug manifest"),
    ],
)
def test_damaged_checkpoint_is_refused_before_anything_loads(
    tmp_path: Path, damage: str, expected: str
) -> None:
    accelerator, model, *_ = setup()
    accelerator.save_state(tmp_path / "ckpt")
    version = checkpoint.resolve_checkpoint(tmp_path / "ckpt")
    assert version is not None
    target = version / "rank_0.safetensors"  # read last: the model would be loaded already
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-7])
    elif damage == "grow":
        target.write_bytes(target.read_bytes() + b"\0" * 7)
    elif damage == "corrupt":
        data = bytearray(target.read_bytes())
        data[-3] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "missing":
        target.unlink()
    elif damage == "fifo":
        target.unlink()
        os.mkfifo(target)
    elif damage == "foreign":
        target = version / "notes.txt"
        target.write_text("x")
    else:
        target = version / layout.MANIFEST
        target.write_text("{not json")
    with torch.no_grad():
        model.weight.add_(1.0)
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match=expected) as info:
        accelerator.load_state(tmp_path / "ckpt")
    assert info.value.file == str(target) and str(target) in str(info.value)
    assert unchanged(model, before)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"optimizer": torch.optim.SGD}, "holds the state of a torch.optim.adam.Adam"),
        ({"width": 5}, "has shape \\[3, 4\\], the model's has \\[5, 4\\]"),
    ],
)
def test_mismatched_objects_are_refused(
    tmp_path: Path, kwargs: dict[str, Any], expected: str
) -> None:
    setup()[0].save_state(tmp_path / "ckpt")
    accelerator, model, *_ = setup(**kwargs)
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match=expected):
        accelerator.load_state(tmp_path / "ckpt")
    assert unchanged(model, before)


def test_disk_full_names_the_directory_and_keeps_the_previous(
    tmp_path: Path, monkeypatch: Any
) -> None:
    accelerator, *_ = setup()
    accelerator.save_state(tmp_path / "ckpt")
    previous = checkpoint.resolve_checkpoint(tmp_path / "ckpt")
    assert previous is not None
    before = snapshot(tmp_path)
    real = codec.write_state
    calls = []

    def full_disk(path: Path, state: Any, extra: Any = None) -> tuple[int, str]:
        calls.append(path)
        record = real(path, state, extra)
        if len(calls) == 2:  # the second file: half written, then ENOSPC
            os.truncate(path, record[0] // 2)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return record

    monkeypatch.setattr(codec, "write_state", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device") as info:
        accelerator.save_state(tmp_path / "ckpt")
    assert str(tmp_path / "ckpt") in str(info.value)
    assert snapshot(tmp_path) == before  # the staging version is gone, the previous intact
    monkeypatch.setattr(codec, "write_state", real)
    accelerator.load_state(tmp_path / "ckpt")


def test_unstorable_state_is_refused_when_saving(tmp_path: Path) -> None:
    accelerator, *_ = setup()

    class Odd(Counter):
        def state_dict(self) -> dict[str, Any]:
            return {"when": socket}  # a module: nothing a checkpoint may hold

    accelerator.register_for_checkpointing(Odd())
    with pytest.raises(CheckpointError, match=r"custom_1.safetensors.*module at when"):
        accelerator.save_state(tmp_path / "ckpt")
    assert checkpoint.resolve_checkpoint(tmp_path / "ckpt") is None


HOLD = """
import sys, time
from pathlib import Path
from kwplug.checkpoint import _lock as lock
with lock.locked(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_second_saver_is_refused_and_a_dead_ones_lock_taken_over(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        accelerator, *_ = setup()
        expected = f"host {socket.gethostname()}, pid {holder.pid}"
        with pytest.raises(CheckpointError, match=expected):
            accelerator.save_state(directory)
        assert checkpoint.resolve_checkpoint(directory) is None
    finally:
        holder.kill()
        holder.wait()
    # The holder died holding the lock: its file still names it, and is taken over.
    assert json.loads((directory / layout.LOCK).read_text())["pid"] == holder.pid
    accelerator.save_state(directory)
    assert checkpoint.resolve_checkpoint(directory) is not None
    assert manifest.read(checkpoint.resolve_checkpoint(directory) or directory)


class Residual:
    """A wrapper's per-rank state, e.g. a compression hook's error feedback."""

    def __init__(self) -> None:
        self.value = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


class Wrapped(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)  # type: ignore[no-any-return]


@attrs.define
class WrapperPlugin(kwplug.KwargsHandler):
    """A third-party wrapper plugin handing its state to checkpoints as the DDP handler does."""

    residual: Residual = attrs.field(factory=Residual)

    @kwplug.hookimpl
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        wrapped = Wrapped(model)
        checkpoint.attach_state(wrapped, self.residual)
        return wrapped


@attrs.define
class ContractWrapperPlugin(WrapperPlugin):
    """The same plugin through the contract module plugins import (never kwplug.checkpoint)."""

    @kwplug.hookimpl
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        wrapped = Wrapped(model)
        kwplug.attached_state.attach_state(wrapped, self.residual)
        return wrapped


@pytest.mark.parametrize("plugin_class", [WrapperPlugin, ContractWrapperPlugin])
def test_a_wrapper_plugin_attaches_its_state(
    tmp_path: Path, plugin_class: type[WrapperPlugin]
) -> None:
    plugin = plugin_class()
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[plugin])
    model = accelerator.prepare(torch.nn.Linear(4, 3))
    assert checkpoint.attached_states(model) == [plugin.residual]
    plugin.residual.value += 2.5
    accelerator.save_state(tmp_path / "ckpt")
    plugin.residual.value.zero_()
    accelerator.load_state(tmp_path / "ckpt")
    assert torch.equal(plugin.residual.value, torch.full((3,), 2.5))


def _pages(path: Path) -> int:
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in path.rglob("*") if p.is_file())


def test_disk_full_on_a_real_small_tmpfs(tmp_path: Path) -> None:
    accelerator, *_ = setup()
    accelerator.save_state(tmp_path / "probe")
    version = _pages(tmp_path / "probe") + 4096  # one version and the lock, in pages
    mount = tmp_path / "small"
    mount.mkdir()
    size = version + version // 2 // 4096 * 4096  # room for one version and a half
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr!r}")
    try:
        accelerator.save_state(mount / "ckpt")
        before = snapshot(mount)
        with pytest.raises(CheckpointError, match="No space left on device") as info:
            accelerator.save_state(mount / "ckpt")
        assert str(mount / "ckpt") in str(info.value)
        assert snapshot(mount) == before
        accelerator.load_state(mount / "ckpt")
    finally:
        subprocess.run(["umount", str(mount)], check=True)

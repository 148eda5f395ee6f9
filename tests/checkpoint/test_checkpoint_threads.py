"""Checkpoint loads share work between threads and hash no byte more than needed (issue 18,
time goal), keeping every guarantee: nothing changes before every file is verified, what is
loaded is exactly the bytes whose checksum matched, a thread's failure is a refusal naming
its file."""

from __future__ import annotations

import collections
import errno
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import kwplug
from kwplug import checkpoint
from kwplug.checkpoint import CheckpointError
from kwplug.checkpoint import _checksum as checksum
from kwplug.checkpoint import _codec as codec
from kwplug.checkpoint import _reader as reader


def _setup() -> tuple[kwplug.Accelerator, Any, Any]:
    torch.manual_seed(0)
    accelerator = kwplug.Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    return accelerator, model, optimizer


def _file(directory: Path, name: str) -> Path:
    version = checkpoint.resolve_checkpoint(directory)
    assert version is not None
    return version / name


def test_the_first_pass_verifies_two_files_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    accelerator, *_ = _setup()
    accelerator.save_state(tmp_path / "ckpt")
    real = reader.read_state
    lock, running, both = threading.Lock(), [0], threading.Event()

    def meeting(path: Path, expected: Any, *, shapes_only: bool = False) -> Any:
        with lock:
            running[0] += 1
            if running[0] >= 2:
                both.set()
        both.wait(timeout=10)  # one file at a time: never set, the load waits 10 s per file
        try:
            return real(path, expected, shapes_only=shapes_only)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(reader, "read_state", meeting)
    accelerator.load_state(tmp_path / "ckpt")
    assert both.is_set()


def test_a_held_file_changed_after_its_one_pass_loads_the_verified_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A model whose loading runs code of its own (here a load_state_dict post hook) is loaded
    # from a private copy, not read into its parameters (:mod:`._direct`). Its file, loaded
    # first, is decoded and hashed once, in the first pass, and its tensors held until
    # loaded: a change made after that pass is never read.
    accelerator, model, _ = _setup()
    hooked: list[int] = []
    model.register_load_state_dict_post_hook(lambda *_: hooked.append(1))
    accelerator.save_state(tmp_path / "ckpt")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    target = _file(tmp_path / "ckpt", "model_0.safetensors")
    real = reader.read_state
    reads: list[bool] = []  # shapes_only of each read of the model's file

    def tamper_after(path: Path, expected: Any, *, shapes_only: bool = False) -> Any:
        result = real(path, expected, shapes_only=shapes_only)
        if path == target:
            reads.append(shapes_only)
        if path == target and not shapes_only:
            with path.open("r+b") as handle:
                handle.seek(-4, os.SEEK_END)
                handle.write(b"\x00\x00\x80\x7f")  # the last bias becomes +inf
        return result

    monkeypatch.setattr(reader, "read_state", tamper_after)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    accelerator.load_state(tmp_path / "ckpt")
    assert reads == [False]  # read once: decoded and hashed in the first pass, not twice
    assert hooked == [1]
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        accelerator.load_state(tmp_path / "ckpt")  # the change itself is refused


def test_a_verifying_thread_error_is_a_refusal_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    accelerator, model, _ = _setup()
    accelerator.save_state(tmp_path / "ckpt")
    target = _file(tmp_path / "ckpt", "optimizer_0.safetensors")
    real = checksum.of_file

    def failing(fd: int, algorithm: str = checksum.ALGORITHM) -> tuple[int, str]:
        if os.readlink(f"/proc/self/fd/{fd}") == str(target):
            assert threading.current_thread() is not threading.main_thread()
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, algorithm)

    monkeypatch.setattr(checksum, "of_file", failing)
    with torch.no_grad():
        model[0].weight.zero_()
    with pytest.raises(CheckpointError, match="could not be read: OSError") as caught:
        accelerator.load_state(tmp_path / "ckpt")
    assert caught.value.file == str(target)
    assert torch.count_nonzero(model[0].weight) == 0  # refused before anything was loaded


def test_a_read_error_while_decoding_is_a_refusal_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The model's file is decoded from one read of it (in the calling thread): a disk error
    # in that read refuses the load, naming the file, before anything is loaded.
    accelerator, model, _ = _setup()
    accelerator.save_state(tmp_path / "ckpt")
    target = _file(tmp_path / "ckpt", "model_0.safetensors")
    real = os.preadv

    def failing(fd: int, buffers: list[Any], offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") == str(target):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", failing)
    with torch.no_grad():
        model[0].weight.zero_()
    with pytest.raises(CheckpointError, match="could not be read: OSError") as caught:
        accelerator.load_state(tmp_path / "ckpt")
    assert caught.value.file == str(target)
    assert torch.count_nonzero(model[0].weight) == 0


def test_save_hashes_while_fsync_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The checksum of a state file is computed while its fsync waits for the disk, not after.
    accelerator, *_ = _setup()
    hashing: dict[int, threading.Event] = collections.defaultdict(threading.Event)  # by inode
    syncs: list[bool] = []
    real_sum, real_fsync = codec.checksum_written, os.fsync

    def checksum_written(fd: int, tensors: Any, path: Path) -> tuple[int, str]:
        hashing[os.fstat(fd).st_ino].set()
        return real_sum(fd, tensors, path)

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors"):
            syncs.append(hashing[os.fstat(fd).st_ino].wait(timeout=5))  # its hash has started
        real_fsync(fd)

    monkeypatch.setattr(codec, "checksum_written", checksum_written)
    monkeypatch.setattr(os, "fsync", fsync)
    accelerator.save_state(tmp_path / "ckpt")
    assert syncs and all(syncs)
    version = checkpoint.resolve_checkpoint(tmp_path / "ckpt")
    assert version is not None
    accelerator.load_state(tmp_path / "ckpt")  # the hashes recorded are the files'


_LOAD_IN_A_FRESH_INTERPRETER = """
import sys, torch, kwplug
torch.manual_seed(0)
accelerator = kwplug.Accelerator(cpu=True)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(4)])
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
model, optimizer = accelerator.prepare(model, optimizer)
grad = torch.ones(2048, 2048)
for param in model.parameters():
    param.grad = grad
optimizer.step()
del grad  # (freed, it raises glibc's mmap threshold: later tensors come from malloc's heaps)
optimizer.zero_grad(set_to_none=True)
def status(field):
    with open("/proc/self/status", encoding="ascii") as handle:
        return next(int(l.split()[1]) * 1024 for l in handle if l.startswith(field + ":"))
with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
    handle.write("5")  # the peak starts again from the current resident set
before = status("VmRSS")
accelerator.load_state(sys.argv[1])
print(status("VmHWM") - before)
"""


def test_a_held_file_does_not_add_to_the_peak_memory_of_a_load(tmp_path: Path) -> None:
    # 16 MiB tensors, as a real model's, in a fresh interpreter (as a resumed run loads) after
    # a training step: the held file's tensors must be freed where the next file's are
    # allocated (decoded in a worker thread, whose malloc heap kept them resident, the peak
    # was 2x the file).
    def run(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", _LOAD_IN_A_FRESH_INTERPRETER, *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            check=False,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    accelerator = kwplug.Accelerator(cpu=True)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(4)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    model, optimizer = accelerator.prepare(model, optimizer)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    accelerator.save_state(tmp_path / "ckpt")
    largest = max(p.stat().st_size for p in _file(tmp_path / "ckpt", "").iterdir())
    assert int(run(str(tmp_path / "ckpt")).split()[-1]) < 1.1 * largest

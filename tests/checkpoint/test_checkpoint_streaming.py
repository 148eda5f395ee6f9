"""Checkpoints stream (issue 18, item 2; issue 31): sizes and file types checked with
``fstat`` before a byte is read, checksums (xxh3-128) in chunks, each file decoded from one
read of it, hashed as read, one file at a time, files written by ``save_file`` from the
tensors."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import xxhash

import kwplug
from kwplug import checkpoint
from kwplug.checkpoint import CheckpointError
from kwplug.checkpoint import _checksum as checksum
from kwplug.checkpoint import _direct as direct
from kwplug.checkpoint import _reader as reader

MIB = 1 << 20


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(field)


def _peak_extra(action: Any) -> int:
    """Bytes the resident set grew at its peak while ``action()`` ran (Linux ``VmHWM``)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")  # the peak starts again from the current resident set
    before = _status("VmRSS")
    action()
    return _status("VmHWM") - before


def _setup(width: int = 4, layers: int = 1) -> tuple[kwplug.Accelerator, Any, Any]:
    torch.manual_seed(0)
    accelerator = kwplug.Accelerator(cpu=True)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return accelerator, model, optimizer


def _version(directory: Path) -> Path:
    version = checkpoint.resolve_checkpoint(directory)
    assert version is not None
    return version


def test_a_sparse_2gib_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    accelerator, model, _ = _setup()
    accelerator.save_state(tmp_path / "ckpt")
    target = _version(tmp_path / "ckpt") / "model_0.safetensors"
    target.unlink()
    with target.open("wb") as handle:
        handle.truncate(2 << 30)  # 2 GiB of holes: no disk used, 2 GiB if read
    with torch.no_grad():
        model[0].weight.add_(1.0)
    before = model[0].weight.detach().clone()

    def load() -> None:
        with pytest.raises(CheckpointError, match=r"2147483648 bytes, the manifest says"):
            accelerator.load_state(tmp_path / "ckpt")

    assert _peak_extra(load) < 64 * MIB  # today: + 2 GiB, the file read whole
    assert torch.equal(model[0].weight, before)


def test_checksums_are_computed_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(3 * checksum.CHUNK + 5)
    path = tmp_path / "blob"
    path.write_bytes(data)
    requests: list[int] = []
    real = os.preadv

    def preadv(fd: int, buffers: list[bytearray], offset: int) -> int:
        requests.append(sum(len(b) for b in buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert checksum.of_file(fd) == (len(data), f"xxh3-128:{xxhash.xxh3_128_hexdigest(data)}")
        assert checksum.of_file(fd, "sha256") == (
            len(data),
            f"sha256:{hashlib.sha256(data).hexdigest()}",
        )
    finally:
        os.close(fd)
    assert len(requests) >= 8 and max(requests) <= checksum.CHUNK
    assert reader.record(path) == (len(data), f"xxh3-128:{xxhash.xxh3_128_hexdigest(data)}")


def test_round_trip_is_exact_for_every_dtype(tmp_path: Path) -> None:
    class Mixed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.low = torch.nn.Parameter(torch.randn(3, 5).to(torch.bfloat16))
            self.wide = torch.nn.Parameter(torch.randn(7, dtype=torch.float64))
            self.register_buffer("count", torch.tensor(41, dtype=torch.int64))
            self.register_buffer("mask", torch.tensor([True, False, True]))
            self.register_buffer("empty", torch.zeros(0, 4))

    accelerator = kwplug.Accelerator(cpu=True)
    model = Mixed()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    (model.low.float().sum() + model.wide.sum()).backward()
    optimizer.step()
    accelerator.save_state(tmp_path / "ckpt")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    inner = optimizer.optimizer
    moments = {k: v.clone() for k, v in inner.state[model.low].items()}

    fresh_accelerator = kwplug.Accelerator(cpu=True)
    fresh = Mixed()
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    fresh, fresh_optimizer = fresh_accelerator.prepare(fresh, fresh_optimizer)
    fresh_accelerator.load_state(tmp_path / "ckpt")
    for name, value in fresh.state_dict().items():
        assert value.dtype == saved[name].dtype and torch.equal(value, saved[name]), name
    loaded = fresh_optimizer.optimizer.state[fresh.low]
    for name, value in moments.items():
        assert torch.equal(loaded[name], value), name


def test_load_reads_each_byte_once_per_pass_in_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each file is checked in the first pass, then read once more when loaded: straight into
    # the parameters and the optimizer's state tensors, which keep their memory (no new
    # memory). Never a whole file in one read, never safetensors' copying load(bytes).
    accelerator, model, optimizer = _setup(width=256, layers=4)  # 1 MiB of weights, 1 of momentum
    params = {k: v.data_ptr() for k, v in model.state_dict().items()}
    moments = [s["momentum_buffer"] for s in optimizer.optimizer.state.values()]
    pointers = [m.data_ptr() for m in moments]
    accelerator.save_state(tmp_path / "ckpt")
    version = _version(tmp_path / "ckpt")
    read: dict[str, int] = {}
    sizes: list[int] = []
    real_preadv, real_pread = os.preadv, os.pread

    def preadv(fd: int, buffers: list[Any], offset: int) -> int:
        count = real_preadv(fd, buffers, offset)
        name = Path(os.readlink(f"/proc/self/fd/{fd}")).name
        read[name] = read.get(name, 0) + count
        sizes.append(sum(memoryview(b).nbytes for b in buffers))
        return count

    def pread(fd: int, count: int, offset: int) -> bytes:
        sizes.append(count)
        return real_pread(fd, count, offset)

    def whole(*_: Any, **__: Any) -> Any:
        raise AssertionError("a state file was decoded by safetensors.torch.load")

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(safetensors.torch, "load", whole)
    accelerator.load_state(tmp_path / "ckpt")
    model_bytes = (version / "model_0.safetensors").stat().st_size
    optimizer_bytes = (version / "optimizer_0.safetensors").stat().st_size
    assert model_bytes > MIB and optimizer_bytes > MIB
    # checked (the whole file), then read into the tensors (the header by pread)
    assert model_bytes < read["model_0.safetensors"] <= 2 * model_bytes
    assert optimizer_bytes < read["optimizer_0.safetensors"] <= 2 * optimizer_bytes
    assert max(sizes) <= checksum.CHUNK
    for key, pointer in params.items():  # loaded in place: the same memory
        assert model.state_dict()[key].data_ptr() == pointer, key
    states = [s["momentum_buffer"] for s in optimizer.optimizer.state.values()]
    assert [m.data_ptr() for m in states] == pointers
    assert all(a is b for a, b in zip(states, moments, strict=True))


def _corrupt_last_value(path: Path) -> None:
    with path.open("r+b") as handle:
        handle.seek(-4, os.SEEK_END)
        handle.write(b"\x00\x00\x80\x7f")  # the last float32 becomes +inf


def test_a_file_changed_after_verification_into_a_fresh_optimizer_is_never_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An optimizer with no state yet is loaded from a private copy of its file, decoded once
    # it matched: changed after the first pass, it is refused on its second hash, unloaded.
    accelerator, _, optimizer = _setup(width=64)
    accelerator.save_state(tmp_path / "ckpt")
    target = _version(tmp_path / "ckpt") / "optimizer_0.safetensors"
    real = reader.read_state

    def tamper(path: Path, expected: Any, *, shapes_only: bool = False) -> Any:
        if path == target and not shapes_only:  # verified already: now change it in place
            _corrupt_last_value(path)
        return real(path, expected, shapes_only=shapes_only)

    monkeypatch.setattr(reader, "read_state", tamper)
    optimizer.optimizer.state.clear()
    with pytest.raises(CheckpointError, match="does not match its checksum") as caught:
        accelerator.load_state(tmp_path / "ckpt")
    assert caught.value.file == str(target)
    assert not optimizer.optimizer.state


def test_a_file_changed_between_verification_and_a_load_in_place_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An optimizer whose state exists is read straight into it, hashed as read: a change made
    # after the first pass (another program writing into the checkpoint) is refused by name,
    # after the copy, and the changed value is what the state tensor holds.
    accelerator, _, optimizer = _setup(width=64)
    accelerator.save_state(tmp_path / "ckpt")
    target = _version(tmp_path / "ckpt") / "optimizer_0.safetensors"
    real = direct.read_into

    def tamper(path: Path, expected: Any, live: Any) -> Any:
        if path == target:  # verified already: now change it in place
            _corrupt_last_value(path)
        return real(path, expected, live)

    monkeypatch.setattr(direct, "read_into", tamper)
    with pytest.raises(CheckpointError, match="changed while it was loaded") as caught:
        accelerator.load_state(tmp_path / "ckpt")
    assert caught.value.file == str(target)
    assert "hold part of it" in str(caught.value)
    moments = [s["momentum_buffer"] for s in optimizer.optimizer.state.values()]
    assert any(bool(torch.isinf(m).any()) for m in moments)  # the changed bytes, copied
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        accelerator.load_state(tmp_path / "ckpt")  # the change itself: before any change


def test_a_file_damaged_before_the_load_changes_nothing(tmp_path: Path) -> None:
    accelerator, model, optimizer = _setup(width=64)
    accelerator.save_state(tmp_path / "ckpt")
    _corrupt_last_value(_version(tmp_path / "ckpt") / "optimizer_0.safetensors")
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    for state in optimizer.optimizer.state.values():
        state["momentum_buffer"].zero_()
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        accelerator.load_state(tmp_path / "ckpt")
    assert all(torch.count_nonzero(p) == 0 for p in model.parameters())
    assert all(
        torch.count_nonzero(s["momentum_buffer"]) == 0 for s in optimizer.optimizer.state.values()
    )


def test_memory_of_save_and_load_stays_near_one_file(tmp_path: Path) -> None:
    accelerator, *_ = _setup(width=1024, layers=16)  # 64 MiB of weights, 64 of momentum
    largest = 64 * MIB
    save = _peak_extra(lambda: accelerator.save_state(tmp_path / "ckpt"))
    load = _peak_extra(lambda: accelerator.load_state(tmp_path / "ckpt"))
    assert save < 0.25 * largest  # today: each file built in memory, 3x
    assert load < 1.1 * largest  # today: every file's bytes and tensors, 4x


def test_save_writes_from_the_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def whole(*_: Any, **__: Any) -> Any:
        raise AssertionError("a state file was built in memory")

    accelerator, *_ = _setup()
    monkeypatch.setattr(safetensors.torch, "save", whole)
    accelerator.save_state(tmp_path / "ckpt")
    version = _version(tmp_path / "ckpt")
    state = safetensors.torch.load_file(version / "model_0.safetensors")
    assert set(state) == {"0.weight", "0.bias"}

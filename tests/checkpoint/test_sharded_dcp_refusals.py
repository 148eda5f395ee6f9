"""A sharded checkpoint (2 processes, SHARDED_STATE_DICT) whose shard was replaced by a pickle,
or beside which a pickled DCP ``.metadata`` was planted, is refused before anything loads, and
the pickle never runs; loading a sharded checkpoint never calls an unpickler."""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import kwplug
from kwplug.checkpoint import _checksum as checksum
from kwplug.checkpoint import _commit as commit
from kwplug.checkpoint import _layout as layout
from kwplug.errors import CheckpointError
from kwplug.testing import PluginSandbox, run_distributed

pytest.importorskip("kwplug_fsdp")


class Payload:
    """A pickle that creates ``path`` when unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 3))


def save(directory: str) -> list[float]:
    from kwplug_fsdp import FullyShardedKwargs

    accelerator = kwplug.Accelerator(
        cpu=True, kwargs_handlers=[FullyShardedKwargs(shard_modules=(nn.Linear,))]
    )
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net, optimizer = accelerator.prepare(net, optimizer)
    accelerator.backward(net(torch.ones(2, 16)).sum())
    optimizer.step()
    accelerator.save_state(directory)
    accelerator.end_training()
    return []


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("sharded") / "ckpt"
    with PluginSandbox(keep_installed=["kwplug-fsdp"]):
        run_distributed(save, str(directory), nproc=2, timeout=240)
    version = commit.resolve_checkpoint(directory)
    assert version is not None
    assert (version / "model_0-shard_00001.safetensors").is_file()
    return version


@pytest.fixture
def copy(saved: Path, tmp_path: Path) -> Iterator[Path]:
    import shutil

    target = tmp_path / "ckpt" / saved.name
    shutil.copytree(saved, target)
    yield target


def load_one_process(directory: Path) -> nn.Module:
    """Load into a plain model and AdamW in this process (DCP reads the full tensors)."""
    accelerator = kwplug.Accelerator(cpu=True)
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net, optimizer = accelerator.prepare(net, optimizer)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    try:
        accelerator.load_state(str(directory))
    except CheckpointError:
        assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())
        assert not optimizer.state  # nothing loaded, nothing created
        raise
    return net


def relist(version: Path, name: str) -> None:
    # Rewrite the manifest so that it vouches for the file as it now is.
    data = (version / name).read_bytes()
    path = version / layout.MANIFEST
    body = json.loads(path.read_text())
    body["files"][name] = [len(data), checksum.of_bytes(data)]
    path.write_text(json.dumps(body))


def test_a_shard_replaced_by_a_pickle_is_refused_and_never_run(copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (copy / "model_0-shard_00001.safetensors").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match="model_0-shard_00001.safetensors"):
        load_one_process(copy.parent)
    relist(copy, "model_0-shard_00001.safetensors")  # and the manifest rewritten to match
    with pytest.raises(CheckpointError, match="looks like a pickle"):
        load_one_process(copy.parent)
    assert not marker.exists()


def test_a_planted_pickled_metadata_is_refused_and_never_run(copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (copy / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match="not listed in the manifest"):
        load_one_process(copy.parent)
    # Listed too (whoever can write the folder can rewrite the manifest): never opened, since
    # DCP's metadata is rebuilt from the shards' safetensors headers, not read from it.
    relist(copy, ".metadata")
    load_one_process(copy.parent)
    assert not marker.exists()


def test_a_sharded_load_calls_no_unpickler(copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an unpickler was called")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    net = load_one_process(copy.parent)
    monkeypatch.undo()
    shards = sorted(p.name for p in copy.iterdir() if layout.is_shard_file(p.name))
    assert shards == [
        f"{kind}_0-shard_{r:05d}.safetensors" for kind in ("model", "optimizer") for r in (0, 1)
    ]
    assert net.state_dict()["0.weight"].shape == (24, 16)


def test_state_dict_type_names_and_refusals() -> None:
    from torch.distributed.fsdp import StateDictType

    from kwplug.checkpoint import _dcp as dcp

    assert dcp.state_dict_type(None) == "SHARDED_STATE_DICT"  # Accelerate 1.16's FSDP2 default
    assert dcp.state_dict_type("full_state_dict") == "FULL_STATE_DICT"
    assert dcp.state_dict_type(StateDictType.SHARDED_STATE_DICT) == "SHARDED_STATE_DICT"
    assert dcp.state_dict_type("1") == "FULL_STATE_DICT"
    for bad in ("LOCAL_STATE_DICT", StateDictType.LOCAL_STATE_DICT, 3.0, "sharded"):
        with pytest.raises(ValueError, match="state_dict_type must be"):
            dcp.state_dict_type(bad)

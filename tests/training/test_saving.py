"""``save``, ``save_model``, ``get_state_dict`` and ``unwrap_model``; ``save_model`` compared
file for file, tensor for tensor with Accelerate's."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import accelerate
import attrs
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import kwplug
from kwplug import KwargsHandler, hookimpl
from kwplug.accelerator import _saving
from kwplug.testing import run_distributed


class Tied(torch.nn.Module):
    """Embedding and output head share one weight; a buffer-holding BatchNorm in between."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.hidden = torch.nn.Linear(16, 32)
        self.norm = torch.nn.BatchNorm1d(32)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight


def model() -> Tied:
    torch.manual_seed(0)
    return Tied()


@pytest.fixture(scope="module")
def reference() -> Iterator[accelerate.Accelerator]:
    yield accelerate.Accelerator(cpu=True)
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("max_shard_size", ["10GB", 3000, "2KB"])
@pytest.mark.parametrize("safe", [True, False])
def test_save_model_matches_accelerate(
    tmp_path: Path, reference: accelerate.Accelerator, max_shard_size: Any, safe: bool
) -> None:
    net = model()
    reference.save_model(net, tmp_path / "a", max_shard_size, safe_serialization=safe)
    kwplug.Accelerator(cpu=True).save_model(
        net, tmp_path / "k", max_shard_size, safe_serialization=safe
    )
    theirs, ours = _files(tmp_path / "a"), _files(tmp_path / "k")
    assert ours.keys() == theirs.keys()
    for name in theirs:
        if name.endswith(".json"):
            assert json.loads(ours[name]) == json.loads(theirs[name])
        elif safe:  # safetensors is canonical: same tensors, same bytes
            assert ours[name] == theirs[name], name
            a, b = load_file(tmp_path / "a" / name), load_file(tmp_path / "k" / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        else:
            a, b = (torch.load(tmp_path / d / name, weights_only=True) for d in "ak")
            assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_sharding_and_tied_weights(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    with caplog.at_level(logging.WARNING):
        accelerator.save_model(model(), tmp_path, max_shard_size="2KB")
    assert "head.weight" in caplog.text  # the tied alias is dropped, the first name kept
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert "head.weight" not in index["weight_map"]
    assert index["weight_map"]["embed.weight"] == "model-00001-of-00003.safetensors"
    with safe_open(tmp_path / "model-00001-of-00003.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    # A smaller save into the same folder removes the shards it does not overwrite.
    accelerator.save_model(model(), tmp_path, max_shard_size=3000)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]


def test_max_shard_size_errors(tmp_path: Path) -> None:
    assert _saving.parse_size("1.5MB") == 1_500_000
    with pytest.raises(ValueError, match="unit of '5XB'"):
        _saving.parse_size("5XB")
    with pytest.raises(ValueError, match="cannot read"):
        _saving.parse_size("fiveMB")
    # An AttributeError ('float' object has no attribute 'strip') and silently accepted before.
    for wrong in (1.5, None, True):
        with pytest.raises(TypeError, match="max_shard_size must be an int"):
            _saving.parse_size(wrong)  # type: ignore[arg-type]
    for negative in (-1, "-1MB"):
        with pytest.raises(ValueError, match="max_shard_size must be >= 0"):
            _saving.parse_size(negative)
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="is a file"):
        kwplug.Accelerator(cpu=True).save_model(model(), tmp_path / "file")


def test_save_writes_on_the_main_process_only(tmp_path: Path) -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    accelerator.save({"a": torch.ones(2)}, tmp_path / "obj.pt")
    assert torch.equal(torch.load(tmp_path / "obj.pt")["a"], torch.ones(2))
    shared = torch.ones(3)
    accelerator.save({"x": shared, "y": shared}, tmp_path / "s.st", safe_serialization=True)
    assert list(load_file(tmp_path / "s.st")) == ["x"]
    accelerator.process_index = 1  # what a second rank sees
    accelerator.save({"a": 1}, tmp_path / "other.pt")
    accelerator.save_model(model(), tmp_path / "model")
    assert not (tmp_path / "other.pt").exists() and not (tmp_path / "model").exists()
    config = kwplug.utils.ProjectConfiguration(save_on_each_node=True)
    node = kwplug.Accelerator(cpu=True, project_config=config)
    node.process_index, node.local_process_index = 1, 0  # main of the second node
    node.save({"a": 1}, tmp_path / "node.pt")
    assert (tmp_path / "node.pt").exists()


def test_unwrap_and_state_dict_of_torch_wrappers() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    net = model()
    compiled = torch.compile(net)
    wrapped = torch.nn.DataParallel(compiled)
    # keep_torch_compile=True (the default, as Accelerate's): the compiled module stays.
    assert accelerator.unwrap_model(wrapped) is compiled
    assert accelerator.unwrap_model(wrapped, keep_fp32_wrapper=False) is compiled
    assert accelerator.unwrap_model(wrapped, keep_torch_compile=False) is net
    state = accelerator.get_state_dict(wrapped)
    assert list(state) == list(net.state_dict())
    assert next(iter(accelerator.get_state_dict(wrapped, unwrap=False))).startswith("module.")


class Wrapper(torch.nn.Module):
    """A third-party wrapper that keeps the module under an attribute torch does not know."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner


@attrs.define
class WrapperPlugin(KwargsHandler):
    """Wraps in ``Wrapper`` and says how to unwrap it."""

    @hookimpl
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return Wrapper(torch.compile(model))

    @hookimpl
    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        return model.inner if isinstance(model, Wrapper) else None


def test_hook_unwrap_model(tmp_path: Path) -> None:
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[WrapperPlugin()])
    net = model()
    prepared = accelerator.prepare(net)
    assert isinstance(prepared, Wrapper)
    # The plugin layer, then torch.compile's (kept by default, as Accelerate keeps it).
    assert accelerator.unwrap_model(prepared, keep_torch_compile=False) is net
    assert accelerator.unwrap_model(prepared)._orig_mod is net
    assert accelerator.unwrap_model(Wrapper(Wrapper(net))) is net
    accelerator.save_model(prepared, tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == set(net.state_dict()) - {"head.weight"}


class Plain(torch.nn.Module):
    """No tied weights: FSDP2 shards every parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 16)
        self.second = torch.nn.Linear(16, 4)


def save_wrapped(directory: str, wrapper: str) -> dict[str, Any]:
    """Rank body: prepare a model (DDP, or FSDP2 through kwplug-fsdp), save it; rank 0 reports
    what it wrote and what the unwrapped model's state is."""
    handlers: list[KwargsHandler] = []
    if wrapper == "fsdp2":
        from kwplug_fsdp import FullyShardedKwargs

        handlers.append(FullyShardedKwargs(shard_modules=(torch.nn.Linear,)))
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=handlers)
    torch.manual_seed(0)
    net = Plain()
    expected = {k: v.clone() for k, v in net.state_dict().items()}
    prepared = accelerator.prepare(net)
    state = accelerator.get_state_dict(prepared)
    accelerator.save_model(prepared, directory, max_shard_size=400)
    accelerator.wait_for_everyone()
    result = {
        "unwrapped": accelerator.unwrap_model(prepared) is net,
        "keys": sorted(state),
        "files": sorted(os.listdir(directory)) if os.path.isdir(directory) else [],
    }
    if accelerator.is_main_process:
        saved: dict[str, torch.Tensor] = {}
        for name in result["files"]:
            if name.endswith(".safetensors"):
                saved.update(load_file(os.path.join(directory, name)))
        result["equal"] = saved.keys() == expected.keys() and all(
            torch.equal(saved[k], expected[k]) for k in expected
        )
    accelerator.end_training()
    return result


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_save_model_of_distributed_wrappers(tmp_path: Path, wrapper: str) -> None:
    if wrapper == "fsdp2":
        pytest.importorskip("kwplug_fsdp")
    directory = str(tmp_path / "model")
    rank0, rank1 = run_distributed(save_wrapped, directory, wrapper, nproc=2, timeout=240)
    assert rank0["unwrapped"] and rank1["unwrapped"]
    assert rank0["equal"] is True
    assert rank0["keys"] == ["first.bias", "first.weight", "second.bias", "second.weight"]
    assert rank0["files"] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    if wrapper == "fsdp2":  # the full state dict is gathered to rank 0 only
        assert rank1["keys"] == []

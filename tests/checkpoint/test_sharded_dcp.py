"""Sharded checkpoints (SHARDED_STATE_DICT, kwplug.checkpoint._dcp): each rank writes its own
shards through torch.distributed.checkpoint; a load on another number of processes, or into
an unsharded (DDP) model, or from a DDP save into FSDP2, gives back the same full tensors
(model and optimizer, ``torch.equal``); a resume at the same size is bitwise exact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from torch import nn

import kwplug
from kwplug.checkpoint import _commit as commit
from kwplug.checkpoint import _layout as layout
from kwplug.checkpoint import _sharded as sharded
from kwplug.testing import PluginSandbox, run_distributed

kwplug_fsdp = pytest.importorskip("kwplug_fsdp")


@attrs.define
class FullStateKwargs(kwplug_fsdp.FullyShardedKwargs):  # type: ignore[misc, name-defined]
    """FSDP2 saved as FULL_STATE_DICT: the ``state_dict_type`` a plugin says (as kwplug's
    ``FullyShardedDataParallelPlugin`` will, with Accelerate's field)."""

    state_dict_type: str = "FULL_STATE_DICT"


#: Tensor parallelism of the test model: the hidden layer by columns, the output by rows.
TP_PLAN = {"0": "colwise", "2": "rowwise"}


def setup(kind: str, state_dict_type: str | None = None) -> tuple[Any, nn.Module, Any]:
    """An Accelerator with an FSDP2 (``kind="fsdp"``), a tensor-parallel (``"tp"``) or a DDP
    model and AdamW."""
    from kwplug_fsdp import FullyShardedKwargs

    handlers: list[Any] = []
    if kind == "fsdp":
        cls = FullStateKwargs if state_dict_type == "FULL_STATE_DICT" else FullyShardedKwargs
        handlers.append(cls(shard_modules=(nn.Linear,)))
    options: dict[str, Any] = {}
    if kind == "tp":  # the built-in parallelism plugin: 2-way tensor parallelism
        options["parallelism_config"] = kwplug.ParallelismConfig(tp_size=2, tp_handler=TP_PLAN)
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=handlers, **options)
    torch.manual_seed(0)
    # 16 -> 24 -> 3: shapes that do not divide by 4 (uneven shards, empty ones at 4 ranks).
    model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def full_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Model and optimizer tensors by name, in full (rank 0; collective when sharded)."""
    inner = getattr(model, "module", model)  # DDP's
    if sharded.is_sharded(inner):
        # cloned: a replicated DTensor's "full" tensor on the CPU is its local tensor itself
        weights = {k: v.clone() for k, v in sharded.full_model_state(inner).items()}
        state = sharded.full_optimizer_state(inner, optimizer).get("state", {})
    else:
        weights = {k: v.detach().clone() for k, v in inner.state_dict().items()}
        names = [name for name, _ in inner.named_parameters()]
        state = {names[i]: s for i, s in optimizer.state_dict()["state"].items()}
    tensors = {
        f"{name}.{key}": value.clone()
        for name, entry in state.items()
        for key, value in entry.items()
        if isinstance(value, torch.Tensor)
    }
    return {"model": weights, "optimizer": tensors}


def step(accelerator: Any, model: nn.Module, optimizer: Any, seed: int) -> float:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=generator)
    loss = nn.functional.mse_loss(model(x), x[:, :3].sin())
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.item())


def save(directory: str, kind: str, state_dict_type: str | None = None) -> dict[str, Any]:
    accelerator, model, optimizer = setup(kind, state_dict_type)
    for i in range(3):
        step(accelerator, model, optimizer, i)
    accelerator.save_state(directory)
    result = full_state(model, optimizer)
    result["after"] = [step(accelerator, model, optimizer, 10 + i) for i in range(2)]
    result["final"] = full_state(model, optimizer)["model"]
    accelerator.end_training()
    return result


def load(directory: str, kind: str) -> dict[str, Any]:
    accelerator, model, optimizer = setup(kind)
    accelerator.load_state(directory)
    result = full_state(model, optimizer)
    result["after"] = [step(accelerator, model, optimizer, 10 + i) for i in range(2)]
    result["final"] = full_state(model, optimizer)["model"]
    accelerator.end_training()
    return result


def assert_equal(saved: dict[str, Any], loaded: dict[str, Any], parts: tuple[str, ...]) -> None:
    for part in parts:
        assert saved[part].keys() == loaded[part].keys(), part
        for key, value in saved[part].items():
            assert value.dtype == loaded[part][key].dtype, key
            assert torch.equal(value, loaded[part][key]), (part, key)


def files(directory: Path) -> set[str]:
    version = commit.resolve_checkpoint(directory)
    assert version is not None
    return {p.name for p in version.iterdir()}


class Saves:
    """Each ``save`` of the module's (kind, process count) runs once, on first use; a test gets
    its own copy of the checkpoint folder. The 2-process FSDP2 save is what three tests load
    (two launches fewer than one save per test; ``save`` is seeded, so each would be the same)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[tuple[str, int], tuple[Path, list[dict[str, Any]], set[str]]] = {}

    def get(self, kind: str, nproc: int, into: Path) -> tuple[list[dict[str, Any]], set[str]]:
        """``save(kind)`` in ``nproc`` processes: its per-rank results and the files of the
        version it wrote, the checkpoint folder copied to ``into``."""
        key = (kind, nproc)
        if key not in self.done:
            directory = self.root / f"{kind}{nproc}"
            with PluginSandbox(keep_installed=["kwplug-fsdp"]):
                saved = run_distributed(save, str(directory), kind, nproc=nproc, timeout=240)
            self.done[key] = (directory, saved, files(directory))
        directory, saved, written = self.done[key]
        shutil.copytree(directory, into, symlinks=True)
        return saved, written


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> Saves:
    return Saves(tmp_path_factory.mktemp("saves"))


@pytest.mark.parametrize(
    ("before", "after"),
    [(("fsdp", 2), ("fsdp", 4)), (("fsdp", 4), ("fsdp", 2)), (("fsdp", 2), ("ddp", 2))],
    ids=["fsdp2-to-fsdp4", "fsdp4-to-fsdp2", "fsdp2-to-ddp2"],
)
def test_sharded_checkpoint_reshards_exactly(
    tmp_path: Path, saves: Saves, before: tuple[str, int], after: tuple[str, int]
) -> None:
    directory = tmp_path / "ckpt"
    saved, written = saves.get(*before, into=directory)
    with PluginSandbox(keep_installed=["kwplug-fsdp"]):
        loaded = run_distributed(load, str(directory), after[0], nproc=after[1], timeout=240)
    # Each rank wrote its own shard files; no full model file, no pickle, no .metadata.
    assert {f"model_0-shard_{r:05d}.safetensors" for r in range(before[1])} <= written
    assert {"model_0-other.state", "optimizer_0-other.state"} <= written
    assert not {"model_0.safetensors", "optimizer_0.safetensors", ".metadata"} & written
    assert saved[0]["optimizer"]  # AdamW has state (exp_avg, exp_avg_sq, step) to compare
    assert_equal(saved[0], loaded[0], ("model", "optimizer"))
    if before[0] == after[0]:  # same layout of reductions: training goes on bitwise
        assert loaded[0]["after"] == saved[0]["after"]
        assert_equal(saved[0], loaded[0], ("final",))
    assert all(rank["after"] == loaded[0]["after"] for rank in loaded)


def test_ddp_checkpoint_loads_into_fsdp(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    with PluginSandbox(keep_installed=["kwplug-fsdp"]):
        saved = run_distributed(save, str(directory), "ddp", nproc=2, timeout=240)
        assert {"model_0.safetensors", "optimizer_0.safetensors"} <= files(directory)
        loaded = run_distributed(load, str(directory), "fsdp", nproc=2, timeout=240)
    assert saved[0]["optimizer"]
    assert_equal(saved[0], loaded[0], ("model", "optimizer"))


def test_sharded_resume_is_bitwise_and_full_state_dict_stays(tmp_path: Path, saves: Saves) -> None:
    sharded_dir, full_dir = tmp_path / "sharded", tmp_path / "full"
    saved, _ = saves.get("fsdp", 2, into=sharded_dir)
    with PluginSandbox(keep_installed=["kwplug-fsdp"]):
        loaded = run_distributed(load, str(sharded_dir), "fsdp", nproc=2, timeout=240)
        # FULL_STATE_DICT from the plugin: rank 0's full files, as before (export).
        full = run_distributed(save, str(full_dir), "fsdp", "FULL_STATE_DICT", nproc=2)
    assert_equal(saved[0], loaded[0], ("model", "optimizer", "final"))
    assert [r["after"] for r in loaded] == [saved[0]["after"]] * 2
    assert {"model_0.safetensors", "optimizer_0.safetensors"} <= files(full_dir)
    assert not any(layout.sharded_prefix_of(name) for name in files(full_dir))
    assert_equal(saved[0], full[0], ("model", "optimizer"))
    manifest = json.loads((commit.resolve_checkpoint(sharded_dir) / layout.MANIFEST).read_text())  # type: ignore[operator]
    assert "model_0-shard_00001.safetensors" in manifest["files"]  # every rank's file listed


def test_tensor_parallel_checkpoint_loads_into_one_process(tmp_path: Path) -> None:
    # TP 2 -> 1: each rank's column/row shards, read back whole into an unsharded model.
    directory = tmp_path / "ckpt"
    with PluginSandbox(keep_installed=["kwplug-fsdp"]):
        saved = run_distributed(save, str(directory), "tp", nproc=2, timeout=240)
        written = files(directory)
        loaded = run_distributed(load, str(directory), "ddp", nproc=1, timeout=240)
    assert {f"model_0-shard_{r:05d}.safetensors" for r in range(2)} <= written
    assert not {"model_0.safetensors", ".metadata"} & written
    assert saved[0]["optimizer"]
    assert_equal(saved[0], loaded[0], ("model", "optimizer"))

"""``register_save_state_pre_hook`` / ``register_load_state_pre_hook`` behave as Accelerate's:
the same script (diffusers' pattern: the hooks save and load one model themselves) gives the
same weights, and kwplug keeps its guarantees (manifest, verification, pruning)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import kwplug
from kwplug import checkpoint
from kwplug.errors import CheckpointError
from kwplug.testing import run_distributed


class Adapter(torch.nn.Linear):
    """The model the hooks save and load themselves (a LoRA adapter in diffusers)."""


def _script(accelerator: Any, directory: Path, mode: str) -> dict[str, Any]:
    """A training script: prepare, train, save with hooks, scramble, load; every Accelerator
    call is one Accelerate has."""
    torch.manual_seed(0)
    adapter, head = Adapter(4, 3), torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD([*adapter.parameters(), *head.parameters()], lr=0.1)
    adapter, head, optimizer = accelerator.prepare(adapter, head, optimizer)
    data = torch.randn(8, 4)
    for _ in range(3):
        loss = head(adapter(data)).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    calls: list[tuple[str, int, int]] = []

    def save_hook(models: list[Any], weights: list[dict[str, Any]], output_dir: str) -> None:
        calls.append(("save", len(models), len(weights)))
        for index, model in enumerate(models):
            unwrapped = accelerator.unwrap_model(model)
            if isinstance(unwrapped, Adapter) and mode == "pop":
                if not accelerator.is_main_process:
                    continue  # diffusers' scripts save and pop on the main process only
                os.makedirs(os.path.join(output_dir, "adapter"), exist_ok=True)
                path = os.path.join(output_dir, "adapter", "weights.safetensors")
                safetensors.torch.save_file(unwrapped.state_dict(), path)
                weights.pop(index)  # not saved by save_state
            elif not isinstance(unwrapped, Adapter) and mode == "modify":
                weights[index]["bias"] = torch.full_like(weights[index]["bias"], 7.0)

    def load_hook(models: list[Any], input_dir: str) -> None:
        calls.append(("load", len(models), 0))
        for model in list(models):
            unwrapped = accelerator.unwrap_model(model)
            if isinstance(unwrapped, Adapter) and mode == "pop":
                path = os.path.join(input_dir, "adapter", "weights.safetensors")
                unwrapped.load_state_dict(safetensors.torch.load_file(path))
                models.remove(model)  # not loaded by load_state

    handles = [
        accelerator.register_save_state_pre_hook(save_hook),
        accelerator.register_load_state_pre_hook(load_hook),
    ]
    trained = [{k: v.clone() for k, v in m.state_dict().items()} for m in (adapter, head)]
    accelerator.save_state(str(directory))
    accelerator.wait_for_everyone()  # Accelerate's save_state does not wait
    with torch.no_grad():
        for parameter in [*adapter.parameters(), *head.parameters()]:
            parameter.zero_()
    accelerator.load_state(str(directory))
    loaded = [{k: v.clone() for k, v in m.state_dict().items()} for m in (adapter, head)]
    for handle in handles:
        handle.remove()
    accelerator.save_state(str(directory) + "-again")  # no hook runs any more
    accelerator.wait_for_everyone()  # Accelerate's save_state does not wait
    accelerator.load_state(str(directory) + "-again")
    return {"trained": trained, "loaded": loaded, "calls": calls}


def _accelerate(directory: Path, mode: str) -> dict[str, Any]:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        return _script(accelerate.Accelerator(cpu=True), directory, mode)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def _equal(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    pairs = zip(a, b, strict=True)
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in pairs)


@pytest.mark.parametrize("mode", ["pop", "modify"])
def test_pre_hooks_match_accelerate(tmp_path: Path, mode: str) -> None:
    theirs = _accelerate(tmp_path / "accelerate", mode)
    ours = _script(kwplug.Accelerator(cpu=True), tmp_path / "kwplug", mode)
    assert ours["calls"] == theirs["calls"] == [("save", 2, 2), ("load", 2, 0)]
    assert _equal(ours["trained"], theirs["trained"])
    assert _equal(ours["loaded"], theirs["loaded"])
    if mode == "pop":  # the hooks restored the adapter; the head came from model_0
        assert _equal(ours["loaded"], ours["trained"])
        version = checkpoint.resolve_checkpoint(tmp_path / "kwplug")
        assert version is not None
        names = set(kwplug.checkpoint._manifest.read(version))
        assert {"adapter/weights.safetensors", "model_0.safetensors"} <= names
        assert "model_1.safetensors" not in names  # Accelerate's numbering: what is left
    else:  # the modified dict is what was saved
        assert torch.equal(ours["loaded"][1]["bias"], torch.full((2,), 7.0))


def _saved_with_hook(tmp_path: Path) -> tuple[kwplug.Accelerator, torch.nn.Module, Path]:
    accelerator = kwplug.Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))

    def save_hook(models: list[Any], weights: list[dict[str, Any]], output_dir: str) -> None:
        Path(output_dir, "notes").mkdir()
        Path(output_dir, "notes", "config.json").write_text("{}")
        weights.pop()

    handle = accelerator.register_save_state_pre_hook(save_hook)
    accelerator.save_state(tmp_path / "ckpt")
    handle.remove()
    version = checkpoint.resolve_checkpoint(tmp_path / "ckpt")
    assert version is not None
    return accelerator, model, version


def test_hook_files_are_verified_before_the_load_hook_runs(tmp_path: Path) -> None:
    accelerator, _, version = _saved_with_hook(tmp_path)
    calls: list[str] = []
    accelerator.register_load_state_pre_hook(lambda models, input_dir: calls.append(input_dir))
    (version / "notes" / "config.json").write_text("[]")  # same size, altered
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        accelerator.load_state(tmp_path / "ckpt")
    assert calls == []


def test_without_the_load_hook_the_missing_model_is_an_error(tmp_path: Path) -> None:
    accelerator, _, _ = _saved_with_hook(tmp_path)
    with pytest.raises(CheckpointError, match=r"model_0\.safetensors is missing"):
        accelerator.load_state(tmp_path / "ckpt")


def test_versions_with_hook_files_are_pruned(tmp_path: Path) -> None:
    accelerator, _, first = _saved_with_hook(tmp_path)
    accelerator.register_save_state_pre_hook(
        lambda models, weights, output_dir: Path(output_dir, "extra.txt").write_text("x")
    )
    accelerator.save_state(tmp_path / "ckpt")
    assert not first.exists()  # listed in its manifest: kwplug's to delete
    version = checkpoint.resolve_checkpoint(tmp_path / "ckpt")
    assert version is not None and (version / "extra.txt").read_text() == "x"


@pytest.mark.parametrize("name", ["model_0.safetensors", "custom_0.safetensors"])
def test_a_hook_writing_kwplugs_names_or_links_is_refused(tmp_path: Path, name: str) -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))
    handle = accelerator.register_save_state_pre_hook(
        lambda models, weights, output_dir: Path(output_dir, name).write_text("")
    )
    with pytest.raises(CheckpointError, match=f"wrote .*{name}, a name kwplug writes"):
        accelerator.save_state(tmp_path / "a")
    handle.remove()
    accelerator.register_save_state_pre_hook(
        lambda models, weights, output_dir: Path(output_dir, "link").symlink_to("/etc/hostname")
    )
    with pytest.raises(CheckpointError, match="not a regular file"):
        accelerator.save_state(tmp_path / "b")
    assert list((tmp_path / "b").iterdir()) == [tmp_path / "b" / ".kwplug.lock"]  # all gone
    with pytest.raises(TypeError, match="callable"):
        accelerator.register_load_state_pre_hook(42)  # type: ignore[arg-type]


def both_libraries_in_two_processes(directory: str) -> dict[str, dict[str, Any]]:
    import accelerate

    ours = _script(kwplug.Accelerator(cpu=True), Path(directory, "kwplug"), "pop")
    theirs = _script(accelerate.Accelerator(cpu=True), Path(directory, "accelerate"), "pop")
    return {"kwplug": ours, "accelerate": theirs}


def test_two_processes_match_accelerate(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    ranks = run_distributed(both_libraries_in_two_processes, str(tmp_path), nproc=2, timeout=240)
    for rank in ranks:
        ours, theirs = rank["kwplug"], rank["accelerate"]
        assert ours["calls"] == theirs["calls"] == [("save", 2, 2), ("load", 2, 0)]
        assert _equal(ours["loaded"], theirs["loaded"])
        assert _equal(ours["loaded"], ours["trained"])


def test_a_save_hook_that_raises_leaves_nothing_and_the_retry_saves(tmp_path: Path) -> None:
    from kwplug.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = kwplug.Accelerator(cpu=True, project_config=config)
    accelerator.prepare(torch.nn.Linear(2, 1))
    fail = [True]

    def hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        (Path(output_dir) / "lora.bin").write_bytes(b"adapter")
        if fail[0]:
            raise RuntimeError("upload failed")

    accelerator.register_save_state_pre_hook(hook)
    with pytest.raises(RuntimeError, match="upload failed"):
        accelerator.save_state()
    leftovers = [p.name for p in (tmp_path / "checkpoints").rglob("*") if p.is_file()]
    assert "lora.bin" not in leftovers
    fail[0] = False
    saved = accelerator.save_state()
    assert saved.name == "checkpoint_0" and list(saved.rglob("lora.bin"))

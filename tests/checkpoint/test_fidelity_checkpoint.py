"""Issue 28, items 1-4, kwplug's side: a save by the main process alone (no hang, what it
holds, what the other ranks are told), the hooks' folders linked into the checkpoint
directory (atomic, never over a user's file, repaired by a load after a kill), and the data
position after ``load_state`` (batch 0 of the saved epoch, INFO log; the exact position with
``exact_data_position=True``). The side-by-side runs with Accelerate are in
tests/parity/test_fidelity.py."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import kwplug
from kwplug.checkpoint import _arrival as arrival
from kwplug.checkpoint import _commit as commit
from kwplug.checkpoint import _sharded as sharded
from kwplug.errors import CheckpointError, KwplugWarning
from kwplug.testing import run_distributed


class _Killed(BaseException):
    """A kill at a commit step (never caught as an error by the save)."""


def _hooked(accelerator: Any, names: list[str]) -> None:
    def save_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        for name in names:  # each a save_pretrained-like folder
            os.makedirs(os.path.join(output_dir, name), exist_ok=True)
            weight = models[0].weight.detach().clone()
            torch.save(weight, os.path.join(output_dir, name, "weight.pt"))

    accelerator.register_save_state_pre_hook(save_hook)


def _prepared(tmp_path: Path) -> tuple[Any, Any]:
    accelerator = kwplug.Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    return accelerator, model


def test_hook_folders_are_linked_into_the_checkpoint_directory(tmp_path: Path) -> None:
    accelerator, model = _prepared(tmp_path)
    names = ["unet", "unet_ema"]
    _hooked(accelerator, names)
    ckpt = tmp_path / "checkpoint-1"
    accelerator.save_state(ckpt)
    for name in names:
        assert (ckpt / name).is_symlink()
        assert os.readlink(ckpt / name) == f"kwplug-00000001/{name}"
        assert torch.equal(torch.load(ckpt / name / "weight.pt"), model.weight.detach())
    with torch.no_grad():
        model.weight.add_(1.0)
    names[:] = ["unet"]  # the second save's hooks write one folder only
    accelerator.save_state(ckpt)
    assert os.readlink(ckpt / "unet") == "kwplug-00000002/unet"
    assert torch.equal(torch.load(ckpt / "unet" / "weight.pt"), model.weight.detach())
    # The first version is pruned, and its link with it (nothing dangles).
    assert not (ckpt / "unet_ema").is_symlink()
    assert sorted(p.name for p in ckpt.iterdir()) == [".kwplug.lock", "kwplug-00000002", "unet"]


def test_a_users_own_folder_is_never_replaced(tmp_path: Path) -> None:
    accelerator, _ = _prepared(tmp_path)
    _hooked(accelerator, ["unet"])
    ckpt = tmp_path / "ckpt"
    (ckpt / "unet").mkdir(parents=True)
    (ckpt / "unet" / "mine.txt").write_text("mine")
    with pytest.warns(KwplugWarning, match="is not kwplug's"):
        accelerator.save_state(ckpt)
    assert not (ckpt / "unet").is_symlink()
    assert [p.name for p in (ckpt / "unet").iterdir()] == ["mine.txt"]
    assert (ckpt / "kwplug-00000001" / "unet" / "weight.pt").is_file()


def test_a_kill_before_the_link_is_repaired_by_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    accelerator, model = _prepared(tmp_path)
    _hooked(accelerator, ["unet"])
    ckpt = tmp_path / "ckpt"
    accelerator.save_state(ckpt)
    with torch.no_grad():
        model.weight.add_(1.0)

    def killed(step: str) -> None:
        if step == "link":  # version 2 is committed; its link not made yet
            raise _Killed

    monkeypatch.setattr(commit, "reached", killed)
    with pytest.raises(_Killed):
        accelerator.save_state(ckpt)
    monkeypatch.undo()
    assert os.readlink(ckpt / "unet") == "kwplug-00000001/unet"  # still a complete version
    accelerator.load_state(ckpt)
    assert os.readlink(ckpt / "unet") == "kwplug-00000002/unet"
    assert torch.equal(torch.load(ckpt / "unet" / "weight.pt"), model.weight.detach())


def test_total_limit_still_prunes_checkpoints_with_hook_links(tmp_path: Path) -> None:
    from kwplug.utils import ProjectConfiguration

    config = ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=1
    )
    accelerator = kwplug.Accelerator(cpu=True, project_config=config)
    accelerator.prepare(torch.nn.Linear(2, 2))
    _hooked(accelerator, ["unet"])
    accelerator.save_state()
    accelerator.save_state()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1"]
    assert (tmp_path / "checkpoints" / "checkpoint_1" / "unet").is_symlink()


def _loader_run(tmp_path: Path, exact: bool | None) -> tuple[list[list[int]], list[list[int]]]:
    torch.manual_seed(0)
    accelerator = kwplug.Accelerator(cpu=True)
    data = TensorDataset(torch.arange(12))
    loader = accelerator.prepare(DataLoader(data, batch_size=2, shuffle=True))
    first = [batch[0].tolist() for batch in loader]  # epoch 0
    epoch1 = []
    for batch in loader:  # epoch 1, saved after 2 batches
        epoch1.append(batch[0].tolist())
        if len(epoch1) == 2:
            accelerator.save_state(tmp_path / "ckpt")
    again = kwplug.Accelerator(cpu=True)
    resumed = again.prepare(DataLoader(data, batch_size=2, shuffle=True))
    if exact is None:
        again.load_state(tmp_path / "ckpt")
    else:
        again.load_state(tmp_path / "ckpt", exact_data_position=exact)
    assert epoch1 != first
    return epoch1, [batch[0].tolist() for batch in resumed]


def test_load_state_starts_the_saved_epoch_at_batch_0_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kwplug"):
        epoch1, resumed = _loader_run(tmp_path, None)
    assert resumed == epoch1  # batch 0 on, in the saved epoch's order
    assert any("saved after 2 batch(es) of epoch 1" in r.getMessage() for r in caplog.records)


def test_exact_data_position_resumes_at_the_next_batch(tmp_path: Path) -> None:
    epoch1, resumed = _loader_run(tmp_path, True)
    assert resumed == epoch1[2:]


def test_exact_data_position_must_be_a_bool(tmp_path: Path) -> None:
    accelerator, _ = _prepared(tmp_path)
    with pytest.raises(TypeError, match="exact_data_position"):
        accelerator.load_state(tmp_path, exact_data_position="yes")


def test_the_wait_is_configurable_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(arrival.WAIT_VARIABLE, raising=False)
    assert arrival.arrival_timeout() == arrival.DEFAULT_WAIT
    monkeypatch.setenv(arrival.WAIT_VARIABLE, "0.5")
    assert arrival.arrival_timeout() == 0.5
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv(arrival.WAIT_VARIABLE, bad)
        with pytest.raises(ValueError, match=arrival.WAIT_VARIABLE):
            arrival.arrival_timeout()


def test_a_sharded_model_saved_by_one_rank_is_an_error_naming_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import attrs

    from kwplug.checkpoint import _api as api

    accelerator, _ = _prepared(tmp_path)
    monkeypatch.setattr(sharded, "is_sharded", lambda module: isinstance(module, torch.nn.Linear))
    sources = attrs.evolve(accelerator._checkpoint_sources(), solo=True)
    with pytest.raises(CheckpointError, match="is sharded .* call save_state on every process"):
        api.save_state(sources, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("kwplug-*"))


def main_only_then_late(directory: str) -> dict[str, Any]:
    """Rank 0 saves alone; rank 1 calls save_state long after rank 0's wait: it must return
    with a warning, not hang; then every rank loads the checkpoint."""
    import warnings

    os.environ[arrival.WAIT_VARIABLE] = "1"
    accelerator = kwplug.Accelerator(cpu=True)
    torch.manual_seed(accelerator.process_index)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    ckpt = Path(directory) / "ckpt"
    caught: list[str] = []
    seen: list[str] = []  # what the hooks got: the models before DDP wrapping (item 2)
    accelerator.register_save_state_pre_hook(
        lambda models, weights, output_dir: seen.extend(type(m).__name__ for m in models)
    )
    accelerator.register_load_state_pre_hook(
        lambda models, input_dir: seen.extend(type(m).__name__ for m in models)
    )
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        if accelerator.is_main_process:
            accelerator.save_state(ckpt)
            accelerator.save_state(ckpt)  # remembered: no second wait
        else:
            time.sleep(3)
            accelerator.save_state(ckpt)
        accelerator.wait_for_everyone()
        rng = torch.get_rng_state()
        with torch.no_grad():
            model.module.weight.zero_()
        accelerator.load_state(ckpt)
        caught = [str(r.message) for r in records]
    files = sorted(p.name for p in next(ckpt.glob("kwplug-*")).iterdir())
    return {
        "warnings": caught,
        "weight": accelerator.unwrap_model(model).weight.detach().clone(),
        "own_rng_kept": torch.equal(rng, torch.get_rng_state()),
        "files": files,
        "hook_models": seen,
    }


def test_save_state_on_the_main_process_only_does_not_hang(tmp_path: Path) -> None:
    ranks = run_distributed(main_only_then_late, str(tmp_path), nproc=2, timeout=240)
    zero, one = ranks
    assert sum("saves alone" in w for w in zero["warnings"]) == 1
    assert any("the main process already saved alone" in w for w in one["warnings"])
    assert any("holds no rank_1.safetensors" in w for w in one["warnings"])
    assert not any("holds no" in w for w in zero["warnings"])
    # Rank 0's weights loaded on both (DDP), rank 1 kept its own RNG, only rank 0's files.
    assert torch.equal(zero["weight"], one["weight"]) and bool(zero["weight"].abs().sum())
    assert one["own_rng_kept"]
    assert zero["hook_models"] == ["Linear"] * 3  # two saves, one load; never DDP
    assert one["hook_models"] == ["Linear"]  # its load (its save was rank 0's)
    assert "rank_1.safetensors" not in zero["files"]
    assert "rank_0.safetensors" in zero["files"]


def stateful_main_only(directory: str) -> dict[str, Any]:
    """A stateful loader (torchdata) saved by rank 0 alone: every rank, rank 1 from the part
    of rank 0's position that is the same on every rank, resumes its own shard at the next
    batch (as Accelerate's stateful loaders resume mid-epoch)."""
    os.environ[arrival.WAIT_VARIABLE] = "1"
    config = kwplug.DataLoaderConfiguration(use_stateful_dataloader=True)

    def build() -> tuple[Any, Any]:
        accelerator = kwplug.Accelerator(cpu=True, dataloader_config=config)
        torch.manual_seed(0)
        data = TensorDataset(torch.arange(32))
        return accelerator, accelerator.prepare(DataLoader(data, batch_size=2, shuffle=True))

    accelerator, loader = build()
    epoch = []
    for batch in loader:
        epoch.append(batch[0].tolist())
        if len(epoch) == 3 and accelerator.is_main_process:
            accelerator.save_state(Path(directory) / "ckpt")
    accelerator.wait_for_everyone()
    again, resumed = build()
    again.load_state(Path(directory) / "ckpt")
    return {"epoch": epoch, "resumed": [batch[0].tolist() for batch in resumed]}


def test_a_stateful_loader_resumes_each_rank_from_a_main_only_checkpoint(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torchdata")
    ranks = run_distributed(stateful_main_only, str(tmp_path), nproc=2, timeout=240)
    for rank in ranks:
        assert rank["resumed"] == rank["epoch"][3:]
    assert ranks[0]["epoch"] != ranks[1]["epoch"]

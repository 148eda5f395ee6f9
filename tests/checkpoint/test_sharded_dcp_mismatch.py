"""A sharded (FSDP2, SHARDED_STATE_DICT) checkpoint in 2 processes: an optimizer that does not
fit, a damaged or missing shard file, and a failed shard write are each one ``CheckpointError``
on every rank, naming what is wrong, raised before any prepared object changes (never torch's
``CheckpointException``, a ``BaseException`` that ``except Exception`` does not catch)."""

from __future__ import annotations

import errno
import json
import pickle
import shutil
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
from kwplug.testing import run_distributed

#: Optimizers that do not fit an AdamW checkpoint, and what the refusal says.
OTHER_OPTIMIZERS = {
    "sgd": "holds the state of a torch.optim.adamw.AdamW, this run's optimizer is a",
    "amsgrad": "the checkpoint lacks state tensor 'state.0.bias.max_exp_avg_sq'",
    "groups": "the saved entries differ from this run's",
}


def prepared(optimizer: str = "adamw") -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    plugin = kwplug.FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = kwplug.Accelerator(cpu=True, fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 33), nn.Tanh(), nn.Linear(33, 3))
    params = list(model.parameters())
    made: torch.optim.Optimizer
    if optimizer == "sgd":
        made = torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    elif optimizer == "groups":
        made = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 1e-3}])
    else:
        made = torch.optim.AdamW(params, lr=1e-2, amsgrad=optimizer == "amsgrad")
    model, made = accelerator.prepare(model, made)
    return accelerator, model, made


def save(directory: str, fail: bool) -> str | None:
    """Train a step and save; with ``fail``, save again with rank 1's shard write failing
    (``ENOSPC``) and return that rank's error message."""
    accelerator, model, optimizer = prepared()
    accelerator.backward(model(torch.ones(2, 8)).sum())
    optimizer.step()
    accelerator.save_state(directory)
    if not fail:
        accelerator.end_training()
        return None
    from kwplug.checkpoint import _dcp_storage

    write = _dcp_storage.codec.write_state

    def full_disk(path: Path, *args: Any, **kwargs: Any) -> Any:
        if accelerator.process_index == 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write(path, *args, **kwargs)

    _dcp_storage.codec.write_state = full_disk  # type: ignore[assignment]
    try:
        accelerator.save_state(directory)
    except CheckpointError as exc:
        return str(exc)
    finally:
        _dcp_storage.codec.write_state = write  # type: ignore[assignment]
        accelerator.end_training()
    return "saved"


def load_refused(directories: dict[str, str]) -> dict[str, tuple[str, bool, bool]]:
    """Load each folder (named by the optimizer to prepare); per folder, the refusal and
    whether the model and the optimizer's state were left as they were."""
    results = {}
    for optimizer, directory in directories.items():
        accelerator, model, made = prepared(optimizer.split("-")[0])
        before = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
        try:
            accelerator.load_state(directory)
            message = "loaded"
        except CheckpointError as exc:
            message = str(exc)
        after = accelerator.get_state_dict(model)
        same = all(torch.equal(v, after[k]) for k, v in before.items())
        results[optimizer] = (message, same, not made.state)
        accelerator.end_training()
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("sharded") / "ckpt"
    run_distributed(save, str(directory), False, nproc=2, timeout=240)
    version = commit.resolve_checkpoint(directory)
    assert version is not None
    return version


def relist(version: Path) -> None:
    # Rewrite the manifest so that it vouches for the files as they now are.
    path = version / layout.MANIFEST
    body = json.loads(path.read_text())
    body["files"] = {}
    for file in sorted(version.iterdir()):
        if file.name not in (layout.MANIFEST, layout.MARKER):
            data = file.read_bytes()
            body["files"][file.name] = [len(data), checksum.of_bytes(data)]
    path.write_text(json.dumps(body))


def test_an_optimizer_that_does_not_fit_is_refused_before_anything_loads(saved: Path) -> None:
    directories = {name: str(saved.parent) for name in OTHER_OPTIMIZERS}
    for rank in run_distributed(load_refused, directories, nproc=2, timeout=240):
        for name, words in OTHER_OPTIMIZERS.items():
            message, model_same, no_state = rank[name]
            assert words in message and "optimizer_0" in message, (name, message)
            assert model_same and no_state, (name, message)


def test_a_damaged_or_missing_shard_is_named_on_every_rank(saved: Path, tmp_path: Path) -> None:
    cases: dict[str, str] = {}
    for case in ("truncated", "pickle", "missing"):
        version = tmp_path / case / saved.name
        shutil.copytree(saved, version)
        cases[f"adamw-{case}"] = str(version.parent)
        if case == "truncated":  # rank 1 hashes only shard 1: it must still name shard 0
            with (version / "model_0-shard_00000.safetensors").open("r+b") as fh:
                fh.truncate(100)
        elif case == "pickle":  # and the manifest rewritten to match: never unpickled
            marker = tmp_path / "ran"
            payload = pickle.dumps((Path.touch, (marker,)))
            (version / "optimizer_0-shard_00001.safetensors").write_bytes(payload)
            relist(version)
        else:  # rank 0's shard gone from files and manifest: the other rows were loaded
            (version / "model_0-shard_00000.safetensors").unlink()
            relist(version)
    for rank in run_distributed(load_refused, cases, nproc=2, timeout=240):
        for name, words in (
            ("adamw-truncated", "model_0-shard_00000.safetensors has 100 bytes"),
            ("adamw-pickle", "optimizer_0-shard_00001.safetensors: it looks like a pickle"),
            ("adamw-missing", "the shards of '0.bias' hold 16 of its 33 elements"),
        ):
            message, model_same, no_state = rank[name]
            assert words in message, (name, message)
            assert model_same and no_state, (name, message)
    assert not (tmp_path / "ran").exists()


def test_a_failed_shard_write_is_a_checkpoint_error_on_every_rank(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    messages = run_distributed(save, str(directory), True, nproc=2, timeout=240)
    for message in messages:
        assert message is not None and "the unfinished version was removed" in message
        assert "rank 1: OSError: [Errno 28] No space left on device" in message
    assert sorted(p.name for p in directory.iterdir()) == [".kwplug.lock", "kwplug-00000001"]

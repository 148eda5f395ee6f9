"""The sharded reader (issue 32, load): DCP's slices read straight into their target tensors
(``preadv``) where a slice is one contiguous span of the target's dtype, through
safetensors' ``pread`` backend otherwise; values as saved either way."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from kwplug.checkpoint import _dcp_storage as storage


def _saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    tensors = {
        "weight": torch.randn(6, 5),
        "half": torch.randn(4, 3).to(torch.bfloat16),
        "step": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
    }
    path = tmp_path / "model_0.safetensors"
    safetensors.torch.save_file(tensors, path)
    return path, tensors


def _load(path: Path, targets: dict[str, torch.Tensor]) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(targets, storage_reader=storage.ShardReader([path]), no_dist=True)


def test_slices_are_read_into_the_targets_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, saved = _saved(tmp_path)
    targets = {k: torch.full_like(v, 3) for k, v in saved.items()}
    memory = {k: v.data_ptr() for k, v in targets.items()}

    def refused(*_: Any, **__: Any) -> Any:
        raise AssertionError("read through safetensors, not into the target")

    monkeypatch.setattr(storage, "safe_open", refused)
    _load(path, targets)
    for key, value in saved.items():
        assert torch.equal(targets[key], value), key
        assert targets[key].data_ptr() == memory[key]  # the live tensor itself, filled


def test_another_dtype_or_a_strided_target_goes_through_safetensors(tmp_path: Path) -> None:
    path, saved = _saved(tmp_path)
    wide = torch.zeros(6, 5, dtype=torch.float64)  # saved float32: converted by copy_
    strided = torch.zeros(3, 4).t()  # (4, 3), not contiguous
    _load(path, {"weight": wide, "half": strided.to(torch.bfloat16)})
    assert torch.equal(wide, saved["weight"].double())
    target = {"half": torch.zeros(3, 4, dtype=torch.bfloat16).t()}
    _load(path, target)
    assert torch.equal(target["half"], saved["half"])


def test_a_file_shorter_than_its_header_is_an_error(tmp_path: Path) -> None:
    path, saved = _saved(tmp_path)
    targets = {k: torch.zeros_like(v) for k, v in saved.items()}
    reader = storage.ShardReader([path])
    metadata = reader.read_metadata()  # the header as verified, then the file shrinks
    with path.open("r+b") as handle:
        handle.truncate(path.stat().st_size - 8)
    planner = DefaultLoadPlanner()
    planner.set_up_planner(targets, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    # The last tensor's span now passes the file's end: never read past it as zeros.
    with pytest.raises((OSError, safetensors.SafetensorError), match="not fully covered|read"):
        reader.read_data(plan, planner).wait()

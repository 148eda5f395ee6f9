"""What a parity script saw, written per rank as JSON when ``PARITY_OUT`` is set.

The ported scripts never call this module: the toy model (:mod:`_toy`) reports the batches it
is fed and the toy metric reports what ``gather_for_metrics`` handed it, so the training calls
stay exactly those of the original script. With ``PARITY_OUT=<path>`` each process writes
``<path>.rank<r>.json`` at exit; without it nothing is recorded.

Record layout::

    {"rank": int, "world_size": int,
     "epochs": [{"train_ids": [[int, ...], ...],   # sample ids of each training batch, in order
                 "train_samples": int,               # their total
                 "eval_ids": [[int, ...], ...],      # ids of each evaluation batch on this rank
                 "eval_gathered": int,               # samples the metric got (after gathering)
                 "metric": float | None}],
     "final_metric": float | None,
     "weights_sha256": [str, ...]}                   # one per model built, in build order

An epoch starts at the first training batch after an evaluation (or at the first batch).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

_OUT = os.environ.get("PARITY_OUT")
_epochs: list[dict[str, Any]] = []
_models: list[torch.nn.Module] = []
_final_metric: list[float | None] = [None]


def enabled() -> bool:
    """Whether this run records (``PARITY_OUT`` is set)."""
    return _OUT is not None


def _epoch(*, opening: bool) -> dict[str, Any]:
    # A training batch after any evaluation opens the next epoch.
    if not _epochs or (opening and (_epochs[-1]["eval_ids"] or _epochs[-1]["metric"] is not None)):
        _epochs.append(
            {
                "train_ids": [],
                "train_samples": 0,
                "eval_ids": [],
                "eval_gathered": 0,
                "metric": None,
            }
        )
    return _epochs[-1]


def model_built(model: torch.nn.Module) -> None:
    """Remember ``model`` (the bare module, before any wrapper) to hash its weights at exit."""
    if enabled():
        _models.append(model)


def batch_seen(ids: torch.Tensor, *, training: bool) -> None:
    """A forward pass on the samples ``ids`` (1-D) in training or evaluation mode."""
    if not enabled():
        return
    id_list = [int(i) for i in ids.reshape(-1).tolist()]
    epoch = _epoch(opening=training)
    if training:
        epoch["train_ids"].append(id_list)
        epoch["train_samples"] += len(id_list)
    else:
        epoch["eval_ids"].append(id_list)


def metric_added(count: int) -> None:
    """The metric received ``count`` (gathered) samples."""
    if enabled():
        _epoch(opening=False)["eval_gathered"] += count


def metric_computed(value: float) -> None:
    """The metric's value for this epoch."""
    if enabled():
        _epoch(opening=False)["metric"] = value
        _final_metric[0] = value


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over the state dict: each key, dtype, shape and the tensor's bytes, in key order."""
    digest = hashlib.sha256()
    for key, tensor in model.state_dict().items():
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{key}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _write() -> None:
    if _OUT is None:
        return
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "rank": rank,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "epochs": _epochs,
        "final_metric": _final_metric[0],
        "weights_sha256": [weights_sha256(m) for m in _models],
    }
    Path(f"{_OUT}.rank{rank}.json").write_text(json.dumps(record))


atexit.register(_write)

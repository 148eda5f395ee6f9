"""Does a saved state fit the object it is about to be loaded into? Each check raises one
:class:`~kwplug.errors.CheckpointError` naming the file and what is wrong."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kwplug.errors import CheckpointError


def _shapes(state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def check_model(path: Path, saved: Any, module: torch.nn.Module) -> None:
    """``saved`` has exactly ``module``'s state dict keys, with the same shapes and dtypes."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path} does not hold a model state dict", path)
    expected, got = _shapes(module.state_dict()), _shapes(saved)
    missing = sorted(expected.keys() - got.keys())
    unexpected = sorted(got.keys() - expected.keys())
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not fit {type(module).__qualname__}: missing keys {missing}, "
            f"unexpected keys {unexpected}",
            path,
        )
    for key, shape in expected.items():
        if got[key] != shape:
            raise CheckpointError(
                f"{path}: {key!r} has shape {list(got[key])}, the model's has {list(shape)}",
                path,
            )
    live = module.state_dict()
    for key in expected:  # load_state_dict would cast silently: a bf16 file into fp32...
        if saved[key].dtype != live[key].dtype:
            raise CheckpointError(
                f"{path}: {key!r} is {saved[key].dtype}, the model's is {live[key].dtype}",
                path,
            )


def check_optimizer(
    path: Path, saved: Any, optimizer: torch.optim.Optimizer, saved_class: str | None
) -> None:
    """``saved`` is a state dict of ``optimizer``'s class, with its groups and shapes."""
    check_class(path, saved_class, qualified_name(optimizer))
    groups, state = (
        (saved.get("param_groups"), saved.get("state")) if isinstance(saved, dict) else (None, None)
    )
    if not isinstance(groups, list) or not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold an optimizer state dict", path)
    live = optimizer.param_groups
    counts = [len(g.get("params", ())) for g in groups]
    if counts != [len(g["params"]) for g in live]:
        raise CheckpointError(
            f"{path} holds parameter groups of sizes {counts}, this run's optimizer has "
            f"{[len(g['params']) for g in live]}",
            path,
        )
    params = {
        key: param
        for group, live_group in zip(groups, live, strict=True)
        for key, param in zip(group["params"], live_group["params"], strict=True)
    }
    for key, values in state.items():
        param = params.get(key)
        for name, value in values.items() if isinstance(values, dict) else ():
            if param is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if value.shape != param.shape:
                raise CheckpointError(
                    f"{path}: {name!r} of parameter {key} has shape {list(value.shape)}, "
                    f"the parameter has {list(param.shape)}",
                    path,
                )


def check_class(path: Path, saved_class: str | None, expected_class: str) -> None:
    """The optimizer state in ``path`` was saved from an ``expected_class`` optimizer."""
    if saved_class != expected_class:
        raise CheckpointError(
            f"{path} holds the state of a {saved_class}, this run's optimizer is a "
            f"{expected_class}",
            path,
        )


def qualified_name(obj: Any) -> str:
    """``module.Class`` of ``obj`` (of the wrapped optimizer for kwplug's scaler wrapper)."""
    inner = getattr(obj, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        obj = inner
    return f"{type(obj).__module__}.{type(obj).__qualname__}"

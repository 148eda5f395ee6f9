"""Tensor parallelism on the ``tp`` dimension of the device mesh, through torch's
``torch.distributed.tensor.parallel.parallelize_module``.

The plan is the user's (``ParallelismConfig(tp_handler={...})``) or the model's own
(``tp_plan``/``_tp_plan``, as transformers models carry): module path (``*`` matches one
level) -> a torch ``ParallelStyle`` or one of the names in :data:`STYLES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def _styles() -> dict[str, Callable[[], Any]]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": SequenceParallel,
    }


#: The style names a plan may use instead of ``ParallelStyle`` objects.
STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "sequence_parallel")


def check_plan(plan: Any, where: str) -> dict[str, Any]:
    """``plan`` as a dict of module path -> ``ParallelStyle`` (names converted).

    Raises:
        TypeError: not a mapping of str to a style.
        ValueError: an unknown style name.
    """
    from torch.distributed.tensor.parallel import ParallelStyle

    if not isinstance(plan, Mapping):
        raise TypeError(
            f"{where} must be a mapping of module path (str) to a torch ParallelStyle or one of "
            f"{', '.join(map(repr, STYLES))}, got {type(plan).__name__}"
        )
    styles = _styles()
    checked: dict[str, Any] = {}
    for path, style in plan.items():
        if not isinstance(path, str):
            raise TypeError(f"{where}: a module path must be a str, got {path!r}")
        if isinstance(style, str):
            if style not in styles:
                raise ValueError(
                    f"{where}[{path!r}]: unknown style {style!r}; use a torch ParallelStyle or "
                    f"one of {', '.join(map(repr, STYLES))}"
                )
            style = styles[style]()
        elif not isinstance(style, ParallelStyle):
            raise TypeError(
                f"{where}[{path!r}] must be a torch ParallelStyle or a style name, got "
                f"{type(style).__name__}"
            )
        checked[path] = style
    return checked


def is_tensor_parallel(model: nn.Module) -> bool:
    """True when ``model`` already holds ``DTensor`` parameters (e.g. a transformers model
    loaded with ``tp_plan="auto"``): nothing is left to parallelise."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: Mapping[str, Any] | None) -> nn.Module:
    """Apply ``plan`` (else the model's ``tp_plan``/``_tp_plan``) over the 1-D ``mesh``.

    Raises:
        ValueError: no plan anywhere.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if is_tensor_parallel(model):
        return model
    where = "ParallelismConfig.tp_handler"
    if plan is None:
        for attribute in ("tp_plan", "_tp_plan"):
            own = getattr(model, attribute, None)
            if own:
                plan, where = own, f"{type(model).__name__}.{attribute}"
                break
    if not plan:
        raise ValueError(
            f"ParallelismConfig(tp_size>1): no tensor-parallel plan for {type(model).__name__}; "
            "pass ParallelismConfig(tp_handler={'module.path': 'colwise' | 'rowwise' | a torch "
            "ParallelStyle, ...}), give the model a tp_plan, or load a transformers model with "
            "tp_plan='auto'"
        )
    parallelize_module(model, mesh, check_plan(plan, where))
    return model

"""Type-checked (not run): ``mypy --strict`` flags every mistake at a hook call site.

Part of the mypy run of ``tests/gates/test_quality.py``. Each wrong call carries the one
``# type: ignore[<code>]`` mypy must report for it; mypy --strict (``warn_unused_ignores``)
fails on an ignore that is no longer needed, so a relay that stopped catching a mistake fails
the gate.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from kwplug import CommHook
from kwplug._plugins import KwplugPluginManager
from kwplug.hookspecs import AutocastFactory
from kwplug.precision import LossScaler


def right(pm: KwplugPluginManager, model: torch.nn.Module) -> None:
    factory: AutocastFactory | None = pm.first.autocast(device_type="cpu", mixed_precision="no")
    scaler: LossScaler | None = pm.first.make_scaler(device_type="cpu", mixed_precision="fp16")
    context: AbstractContextManager[Any] | None = pm.first.no_sync(model=model)
    hooks: list[tuple[str, Mapping[str, CommHook] | None]] = pm.each.comm_hooks()
    states: list[tuple[str, Mapping[str, Any] | None]] = pm.each.handler_state()
    pm.each_of("kwplug:ddp").load_handler_state(state={})
    pm.first_with(None).make_profiler(device_type="cpu", rank=0)
    del factory, scaler, context, hooks, states


def wrong(pm: KwplugPluginManager, model: torch.nn.Module) -> None:
    pm.first.autocats(device_type="cpu", mixed_precision="no")  # type: ignore[attr-defined]
    pm.first.autocast(device_type="cpu")  # type: ignore[call-arg]
    pm.first.autocast(devce_type="cpu", mixed_precision="no")  # type: ignore[call-arg]
    pm.first.autocast("cpu", "no")  # type: ignore[call-arg]
    pm.first.make_profiler(device_type="cpu", rank="0")  # type: ignore[arg-type]
    pm.first.comm_hooks()  # type: ignore[attr-defined]
    pm.each.autocast(device_type="cpu", mixed_precision="no")  # type: ignore[attr-defined]
    pm.each.unwrap_model(module=model)  # type: ignore[call-arg]
    wrapped: torch.nn.Module = pm.first.wrap_model(  # type: ignore[assignment]
        model=model,
        device=torch.device("cpu"),
        device_type="cpu",
        world_size=1,
        mixed_precision="no",
        comm_hooks={},
        device_mesh=None,
    )
    del wrapped

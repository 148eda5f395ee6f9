"""Type-checked (not run) use of kwplug's public API: `mypy --strict` over this file is part of
tests/gates/test_quality.py, so the typed contract users and plugin authors rely on is tested."""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import attrs
import torch

import kwplug
from kwplug import (
    Accelerator,
    Answer,
    AutocastKwargs,
    CommHook,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    hookimpl,
)
from kwplug.hookspecs import AutocastFactory
from kwplug.precision import LossScaler


@attrs.define
class BackendAutocastKwargs(KwargsHandler):
    """A third-party handler with a typed hook implementation."""

    enabled: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))

    @hookimpl
    def autocast(self, device_type: str, mixed_precision: str) -> AutocastFactory | None:
        if device_type != "mydevice":
            return None
        return functools.partial(torch.autocast, device_type, dtype=torch.bfloat16)

    @hookimpl
    def comm_hooks(self) -> dict[str, CommHook]:
        def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
            raise NotImplementedError

        return {"mine": CommHook("mine", hook)}


class StaticScale:
    """A third-party precision backend: a fixed loss scale (mypy checks it is a LossScaler)."""

    def scale(self, outputs: torch.Tensor) -> torch.Tensor:
        return outputs * 128.0

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        del optimizer

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        pass

    def get_scale(self) -> float:
        return 128.0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        del state_dict


@attrs.define
class StaticScaleKwargs(KwargsHandler):
    """A third-party handler answering ``make_scaler`` with its own backend."""

    @hookimpl
    def make_scaler(self, device_type: str, mixed_precision: str) -> LossScaler | None:
        return StaticScale() if mixed_precision == "fp16" else None


def train() -> None:
    handlers: list[KwargsHandler] = [
        AutocastKwargs(enabled=True, cache_enabled=None),
        DistributedDataParallelKwargs(
            bucket_cap_mb=50, comm_hook=DDPCommunicationHookType.BF16, comm_wrapper="no"
        ),
        GradScalerKwargs(init_scale=1024.0, growth_interval=100),
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=60)),
        ProfileKwargs(activities=["cpu"], schedule_option={"wait": 1, "active": 2}),
        BackendAutocastKwargs(),
    ]
    accelerator = Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=handlers)
    device: torch.device = accelerator.device
    rank: int = accelerator.process_index
    scaler: LossScaler | None = accelerator.scaler
    builtin: LossScaler = torch.amp.GradScaler("cpu")  # the built-in answer fits the protocol
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    ctx: AbstractContextManager[Any] = accelerator.autocast()
    with ctx:
        loss = model(torch.ones(2, 4, device=device)).sum()
    accelerator.backward(loss)
    total: torch.Tensor = accelerator.reduce(loss.detach(), "mean")
    answer: Answer = accelerator.plan["autocast"]
    kwargs: dict[str, Any] = handlers[1].to_kwargs()
    del rank, scaler, builtin, total, answer, kwargs
    kwplug.register_comm_hook("noop", lambda state, bucket: torch.futures.Future())
    accelerator.save_state("ckpt")
    accelerator.end_training()

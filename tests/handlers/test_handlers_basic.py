"""AutocastKwargs, GradScalerKwargs, InitProcessGroupKwargs: signatures, to_kwargs, validation,
and what reaches torch."""

from __future__ import annotations

import inspect
import os
from datetime import timedelta
from typing import Any

import pytest
import torch

import kwplug
from kwplug import AutocastKwargs, GradScalerKwargs, InitProcessGroupKwargs


def defaults(cls: type) -> dict[str, Any]:
    return {n: p.default for n, p in inspect.signature(cls).parameters.items()}


def test_signatures_and_defaults() -> None:
    assert defaults(AutocastKwargs) == {"enabled": True, "cache_enabled": None}
    assert defaults(GradScalerKwargs) == {
        "init_scale": 65536.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "enabled": True,
    }
    assert defaults(InitProcessGroupKwargs) == {
        "backend": "nccl",
        "init_method": None,
        "timeout": None,
    }


def test_to_kwargs_only_differences() -> None:
    assert AutocastKwargs().to_kwargs() == {}
    assert AutocastKwargs(cache_enabled=False).to_kwargs() == {"cache_enabled": False}
    assert GradScalerKwargs(init_scale=1024.0, growth_interval=10).to_kwargs() == {
        "init_scale": 1024.0,
        "growth_interval": 10,
    }
    assert InitProcessGroupKwargs().to_kwargs() == {}
    assert InitProcessGroupKwargs().timeout == timedelta(seconds=600)
    assert InitProcessGroupKwargs(backend="gloo").timeout == timedelta(seconds=1800)
    assert InitProcessGroupKwargs(timeout=30).to_kwargs() == {"timeout": timedelta(seconds=30)}
    # A given timeout is kept even when it equals nccl's default (tests/test_compat_points.py).
    handler = InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=600))
    assert handler.to_kwargs() == {"backend": "gloo", "timeout": timedelta(seconds=600)}
    assert handler.timeout == timedelta(seconds=600)


def test_to_dict_has_every_field() -> None:
    assert GradScalerKwargs().to_dict() == defaults(GradScalerKwargs)


def test_to_kwargs_does_not_touch_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    class Spy(dict[str, str]):
        def __getitem__(self, key: str) -> str:
            raise AssertionError(f"os.environ[{key!r}] read")

        def get(self, key: str, default: Any = None) -> Any:
            raise AssertionError(f"os.environ.get({key!r}) read")

    handlers = [
        AutocastKwargs(enabled=False),
        GradScalerKwargs(init_scale=2.0),
        InitProcessGroupKwargs(backend="gloo"),
    ]
    monkeypatch.setattr(os, "environ", Spy())
    for handler in handlers:
        handler.to_kwargs()


@pytest.mark.parametrize(
    ("cls", "field", "value", "error"),
    [
        (AutocastKwargs, "enabled", 1, TypeError),
        (AutocastKwargs, "enabled", "yes", TypeError),
        (AutocastKwargs, "cache_enabled", "no", TypeError),
        (GradScalerKwargs, "init_scale", 0.0, ValueError),
        (GradScalerKwargs, "init_scale", -1.0, ValueError),
        (GradScalerKwargs, "init_scale", "big", TypeError),
        (GradScalerKwargs, "init_scale", float("nan"), ValueError),
        (GradScalerKwargs, "growth_factor", 1.0, ValueError),
        (GradScalerKwargs, "backoff_factor", 1.5, ValueError),
        (GradScalerKwargs, "backoff_factor", 0, ValueError),
        (GradScalerKwargs, "growth_interval", 0, ValueError),
        (GradScalerKwargs, "growth_interval", 1.5, TypeError),
        (GradScalerKwargs, "growth_interval", True, TypeError),
        (GradScalerKwargs, "enabled", None, TypeError),
        (InitProcessGroupKwargs, "backend", "nclL", ValueError),
        (InitProcessGroupKwargs, "backend", 3, TypeError),
        (InitProcessGroupKwargs, "init_method", 5, TypeError),
        (InitProcessGroupKwargs, "timeout", "10s", TypeError),
        (InitProcessGroupKwargs, "timeout", -5, ValueError),
        (InitProcessGroupKwargs, "timeout", timedelta(0), ValueError),
        (InitProcessGroupKwargs, "timeout", float("nan"), ValueError),
        (InitProcessGroupKwargs, "timeout", 1e20, ValueError),
    ],
)
def test_bad_values_name_the_field(cls: type, field: str, value: Any, error: type) -> None:
    with pytest.raises(error, match=field):
        cls(**{field: value})
    handler = cls()
    before = getattr(handler, field)
    with pytest.raises(error, match=field):
        setattr(handler, field, value)
    assert getattr(handler, field) == before  # a rejected assignment loses nothing


def test_assignment_converts_and_resolves() -> None:
    handler = InitProcessGroupKwargs(backend="gloo")
    handler.timeout = 12
    assert handler.timeout == timedelta(seconds=12)
    handler.timeout = None
    assert handler.timeout == timedelta(seconds=1800)


def test_backend_resolution() -> None:
    assert InitProcessGroupKwargs().resolved_backend("cpu") == "gloo"
    assert InitProcessGroupKwargs().resolved_backend("cuda") == "nccl"
    assert InitProcessGroupKwargs(backend="mpi").resolved_backend("cpu") == "mpi"


@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)]
)
def test_autocast_dtype_on_cpu(precision: str, dtype: torch.dtype) -> None:
    accelerator = kwplug.Accelerator(mixed_precision=precision, cpu=True)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with accelerator.autocast():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == dtype
        assert (a @ b).dtype == dtype
        with accelerator.autocast(AutocastKwargs(enabled=False)):
            assert (a @ b).dtype == torch.float32
        assert (a @ b).dtype == dtype
    assert (a @ b).dtype == torch.float32


def test_autocast_off_is_nullcontext() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    with accelerator.autocast():
        assert not torch.is_autocast_enabled("cpu")
        assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.float32


def test_autocast_handler_in_constructor_applies() -> None:
    accelerator = kwplug.Accelerator(
        mixed_precision="bf16", cpu=True, kwargs_handlers=[AutocastKwargs(enabled=False)]
    )
    with accelerator.autocast():
        assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.float32


def test_fp16_scaler_is_real_on_cpu() -> None:
    accelerator = kwplug.Accelerator(
        mixed_precision="fp16",
        cpu=True,
        kwargs_handlers=[
            GradScalerKwargs(
                init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3
            )
        ],
    )
    scaler = accelerator.scaler
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler.is_enabled()
    assert scaler.get_scale() == 1024.0
    assert scaler.get_growth_factor() == 4.0
    assert scaler.get_backoff_factor() == 0.25
    assert scaler.get_growth_interval() == 3
    assert scaler._device == "cpu"

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(optimizer, torch.optim.Optimizer)
    before = model.weight.detach().clone()
    x = torch.randn(16, 8)
    with accelerator.autocast():
        out = model(x)
        # prepare() runs the forward in float16 and converts its output, as Accelerate's.
        assert out.dtype == torch.float32
        assert model.forward.__wrapped__(x).dtype == torch.float16
        loss = out.float().pow(2).mean()
    accelerator.backward(loss)
    # Gradients are scaled by the loss scale, then unscaled by the step.
    expected = torch.autograd.grad(model(x).pow(2).mean(), model.weight)[0]
    assert torch.allclose(model.weight.grad / 1024.0, expected, rtol=0.05, atol=1e-3)
    optimizer.step()
    optimizer.zero_grad()
    assert not torch.equal(model.weight, before)
    assert model.weight.dtype == torch.float32

    # An inf gradient skips the step and backs the scale off.
    weight = model.weight.detach().clone()
    accelerator.backward(model(x).sum() * float("inf"))
    optimizer.step()
    assert optimizer.step_was_skipped
    assert torch.equal(model.weight, weight)
    assert scaler.get_scale() == 1024.0 * 0.25


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_no_scaler_without_fp16(precision: str) -> None:
    accelerator = kwplug.Accelerator(mixed_precision=precision, cpu=True)
    assert accelerator.scaler is None
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    prepared = accelerator.prepare(optimizer)
    # Wrapped for gradient accumulation only: no scaler behind it.
    assert prepared.optimizer is optimizer and prepared.scaler is None


def test_clip_grad_norm_unscales_first() -> None:
    accelerator = kwplug.Accelerator(mixed_precision="fp16", cpu=True)
    model = torch.nn.Linear(4, 1)
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.0))
    x = torch.ones(2, 4)
    accelerator.backward(model(x).sum())
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=1e9)
    expected = torch.cat([torch.full((4,), 2.0), torch.tensor([2.0])]).norm()
    assert torch.allclose(norm, expected)
    optimizer.step()


def test_single_process_with_gloo_handler_does_not_init() -> None:
    # Accelerate raises "Default process group has not been initialized" here.
    accelerator = kwplug.Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    assert accelerator.num_processes == 1
    assert accelerator.process_index == 0
    assert accelerator.is_main_process
    assert not torch.distributed.is_initialized()
    t = torch.arange(3.0)
    assert torch.equal(accelerator.reduce(t, "mean"), t)
    assert torch.equal(accelerator.gather(t), t)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def test_resolved_timeout_follows_backend_until_set() -> None:
    handler = InitProcessGroupKwargs()
    handler.backend = "GLOO"
    assert handler.backend == "gloo"
    assert handler.timeout == timedelta(seconds=1800)
    handler.timeout = 5
    handler.backend = "nccl"
    assert handler.timeout == timedelta(seconds=5)  # explicit values stay
    handler.timeout = None
    assert handler.timeout == timedelta(seconds=600)
    assert InitProcessGroupKwargs(backend="NCCL").to_kwargs() == {}
    with pytest.raises(ValueError, match="'backend' must not be empty"):
        InitProcessGroupKwargs(backend="")

"""Property-based tests: any value either makes a handler whose torch objects build, or raises
TypeError/ValueError naming the field -- never another exception, never a later torch error."""

from __future__ import annotations

import inspect
import math
import re
from datetime import timedelta
from typing import Any

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kwplug import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)
from kwplug.plugins.ddp_comm_hooks import builtin_comm_hooks

EXAMPLES = 500

anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(
        [
            "nccl",
            "gloo",
            "cpu",
            "cuda",
            "xpu",
            "env://",
            "no",
            "fp16",
            "bf16",
            "power_sgd",
            "batched_power_sgd",
            "matrix_approximation_rank",
            "start_powerSGD_iter",
        ]
    )
    | st.builds(timedelta, seconds=st.floats(-1e6, 1e6)),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["wait", "warmup", "active", "repeat", "skip_first", "x"]),
            inner,
            max_size=4,
        )
    ),
    max_leaves=6,
)


def field_values(cls: type) -> st.SearchStrategy[dict[str, Any]]:
    names = [f.name for f in attrs.fields(cls)]
    return st.dictionaries(st.sampled_from(names), anything, max_size=len(names))


def construct(cls: type, kwargs: dict[str, Any]) -> Any:
    """Construct, or check the error names a field it was given; None on a clean rejection."""
    try:
        handler = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        named = [n for n in kwargs if re.search(rf"\b{re.escape(n)}\b", str(exc))]
        assert named, f"{cls.__name__}({kwargs!r}) raised {exc!r}, naming no field"
        return None
    # Assignment validates the same way, and a rejected assignment loses nothing.
    fresh = cls()
    for name, value in kwargs.items():
        before = getattr(fresh, name)
        try:
            setattr(fresh, name, value)
        except (TypeError, ValueError) as exc:
            assert name in str(exc)
            assert getattr(fresh, name) == before
    return handler


FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(field_values(AutocastKwargs), st.sampled_from(["bf16", "fp16"]))
def test_fuzz_autocast(kwargs: dict[str, Any], precision: str) -> None:
    handler = construct(AutocastKwargs, kwargs)
    if handler is not None:
        factory = handler.autocast(device_type="cpu", mixed_precision=precision)
        with factory():
            torch.ones(2, 2) @ torch.ones(2, 2)


@FUZZ
@given(field_values(GradScalerKwargs))
def test_fuzz_grad_scaler(kwargs: dict[str, Any]) -> None:
    handler = construct(GradScalerKwargs, kwargs)
    if handler is not None:
        scaler = handler.make_scaler(device_type="cpu", mixed_precision="fp16")
        assert isinstance(scaler, torch.amp.GradScaler)
        param = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([param], lr=0.1)
        scaler.scale(param.sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        assert math.isfinite(scaler.get_scale()) or not handler.enabled


def test_an_init_scale_beyond_float32_is_refused() -> None:
    # Found by the fuzz test: torch keeps the scale in float32, where 3.402823466385289e38
    # (just above float32's largest value) is inf; inf * backoff stays inf and every step
    # would be skipped in silence. The largest finite float32 is accepted and trains.
    largest = float(torch.finfo(torch.float32).max)
    with pytest.raises(ValueError, match="'init_scale' must be > 0 and <= 3.40282e"):
        GradScalerKwargs(init_scale=3.402823466385289e38)
    scaler = GradScalerKwargs(init_scale=largest).make_scaler(
        device_type="cpu", mixed_precision="fp16"
    )
    assert isinstance(scaler, torch.amp.GradScaler)
    param = torch.nn.Parameter(torch.ones(2))
    scaler.scale(param.sum()).backward()  # gradients of `largest` each: finite
    scaler.step(torch.optim.SGD([param], lr=0.1))
    scaler.update()
    assert scaler.get_scale() == largest and torch.equal(param.detach(), torch.full((2,), 0.9))


@FUZZ
@given(field_values(InitProcessGroupKwargs))
def test_fuzz_init_process_group(kwargs: dict[str, Any]) -> None:
    handler = construct(InitProcessGroupKwargs, kwargs)
    if handler is not None:
        backend = handler.resolved_backend("cpu")
        # A backend torch knows, or None: torch then picks one per device.
        assert backend is None or torch.distributed.Backend(backend)
        assert isinstance(handler.timeout, timedelta) and handler.timeout.total_seconds() > 0
        assert handler.init_method is None or isinstance(handler.init_method, str)


@FUZZ
@given(field_values(ProfileKwargs))
def test_fuzz_profile(kwargs: dict[str, Any]) -> None:
    kwargs.pop("output_trace_dir", None)  # paths are checked in test_profile.py
    handler = construct(ProfileKwargs, kwargs)
    if handler is not None:
        profiler = handler.build("cpu", rank=0)
        assert isinstance(profiler, torch.profiler.profile)


@FUZZ
@given(field_values(DistributedDataParallelKwargs))
def test_fuzz_ddp(kwargs: dict[str, Any]) -> None:
    handler = construct(DistributedDataParallelKwargs, kwargs)
    if handler is not None:
        # What reaches torch binds to DistributedDataParallel's signature...
        inspect.signature(torch.nn.parallel.DistributedDataParallel).bind(
            torch.nn.Linear(1, 1), **handler.to_kwargs()
        )
        # ...and the hook resolves (unknown names and bad state options fail here, before
        # DDP is built, with a ValueError naming the field).
        try:
            handler._hook_and_state(builtin_comm_hooks())
        except ValueError as exc:
            assert "comm_hook" in str(exc) or "comm_state_option" in str(exc)

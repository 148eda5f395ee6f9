"""The per-step wrappers' shortcuts (issue 31, goal 2) keep what users see: ``zero_grad``
passes ``set_to_none`` positionally only to torch's own ``Optimizer.zero_grad``, and
``accelerator.autocast()`` without mixed precision is one reusable ``nullcontext``."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

import kwplug
from kwplug.optimizer import AcceleratedOptimizer


def grads_after_zero_grad(optimizer: torch.optim.Optimizer, **kwargs: Any) -> torch.Tensor | None:
    param = optimizer.param_groups[0]["params"][0]
    param.grad = torch.ones_like(param)
    AcceleratedOptimizer(optimizer).zero_grad(**kwargs)
    return param.grad  # type: ignore[no-any-return]


def test_torch_zero_grad_sets_to_none_by_default_and_zeroes_on_request() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    assert grads_after_zero_grad(optimizer) is None
    assert grads_after_zero_grad(optimizer, set_to_none=True) is None
    kept = grads_after_zero_grad(optimizer, set_to_none=False)
    assert kept is not None and torch.equal(kept, torch.zeros(3))


class KeywordOnlyZeroGrad(torch.optim.SGD):
    """An optimizer whose zero_grad takes set_to_none by keyword only (and records it)."""

    seen: list[bool] = []  # noqa: RUF012

    def zero_grad(self, *, set_to_none: bool = False) -> None:  # type: ignore[override]
        self.seen.append(set_to_none)
        super().zero_grad(set_to_none=set_to_none)


def test_an_overridden_zero_grad_gets_the_keyword() -> None:
    optimizer = KeywordOnlyZeroGrad([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    assert grads_after_zero_grad(optimizer) is None  # Accelerate's default: True
    kept = grads_after_zero_grad(optimizer, set_to_none=False)
    assert kept is not None and torch.equal(kept, torch.zeros(3))
    assert KeywordOnlyZeroGrad.seen == [True, False]


def test_an_instance_patched_zero_grad_gets_the_keyword() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    calls: list[dict[str, Any]] = []
    optimizer.zero_grad = lambda **kwargs: calls.append(kwargs)  # type: ignore[method-assign]
    AcceleratedOptimizer(optimizer).zero_grad()
    assert calls == [{"set_to_none": True}]


def test_autocast_without_mixed_precision_is_one_reusable_nullcontext() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    first, second = accelerator.autocast(), accelerator.autocast()
    assert isinstance(first, contextlib.nullcontext)
    assert first is second  # no object per step
    with first as outer, second as inner:  # nested entries of the same instance
        assert outer is None and inner is None
        assert not torch.is_autocast_enabled("cpu")
    errors: list[BaseException] = []

    def enter_many() -> None:
        try:
            for _ in range(1000):
                with accelerator.autocast():
                    pass
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=enter_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def test_autocast_with_bf16_is_a_fresh_torch_autocast_each_call() -> None:
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="bf16")
    first, second = accelerator.autocast(), accelerator.autocast()
    assert first is not second  # torch.autocast keeps state between enter and exit
    with first:
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16

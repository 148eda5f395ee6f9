"""Optimizers follow parameters that a wrapper replaced (as FSDP2's fully_shard does)."""

from __future__ import annotations

import attrs
import pytest
import torch

from kwplug import Accelerator, GradScalerKwargs, KwargsHandler, hookimpl


@attrs.define
class ReplacingWrapper(KwargsHandler):
    """Registers fresh Parameters (doubled values) in place of the module's, like FSDP2."""

    register_default = False

    @hookimpl
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, torch.nn.Parameter(param.detach() * 2))
        return model


def _step(
    accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    loss = model(torch.ones(2, 3)).sum()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("mixed_precision", ["no", "fp16"])
@pytest.mark.parametrize("order", ["model-first", "optimizer-first", "separate-calls"])
def test_optimizer_steps_the_parameters_the_wrapper_registered(
    order: str, mixed_precision: str
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    old = [p for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    # fp16 runs the prepared forward in float16: torch's default initial scale (2**16) would
    # overflow the float16 gradients and skip the first step, so start lower.
    handlers = [ReplacingWrapper(), GradScalerKwargs(init_scale=1024.0)]
    accelerator = Accelerator(mixed_precision=mixed_precision, kwargs_handlers=handlers)
    if order == "model-first":
        model, optimizer = accelerator.prepare(model, optimizer)
    elif order == "optimizer-first":
        optimizer, model = accelerator.prepare(optimizer, model)
    else:
        optimizer = accelerator.prepare(optimizer)
        model = accelerator.prepare(model)
    new = list(model.parameters())
    assert all(n is not o for n, o in zip(new, old, strict=True))
    assert optimizer.param_groups[0]["params"] == new  # identity: list equality on tensors
    before = [p.detach().clone() for p in new]
    _step(accelerator, model, optimizer)
    assert not accelerator.optimizer_step_was_skipped
    # The parameters the model uses moved; the originals did not.
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert torch.equal(old[0].detach() * 2, before[0])


def test_parameters_shared_by_the_wrapper_are_left_alone() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    params = optimizer.param_groups[0]["params"]
    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(model, optimizer)
    assert optimizer.param_groups[0]["params"] is params
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))

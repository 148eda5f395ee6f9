"""A precision backend is a plugin: a ``make_scaler`` answer with its own loss-scaling rule
changes what ``backward`` scales by, what the optimizer sees, when a step is skipped and how the
scale moves, with no change to the core (issue 19, item 2).

The test plugin below (:class:`HalvingLossScale`) scales by a fixed factor that halves after an
overflow and never grows -- a rule ``torch.amp.GradScaler`` cannot express (its scale grows
after ``growth_interval`` clean steps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import kwplug
from kwplug import KwargsHandler, hookimpl
from kwplug.precision import LossScaler


class HalvingLossScale:
    """Loss scaling by ``scale``, halved after a step whose gradients held inf/NaN (that step
    is skipped), never grown. Records every protocol call in :attr:`calls`."""

    def __init__(self, scale: float) -> None:
        self._scale = scale
        self._found_inf: dict[int, bool] = {}  # per optimizer, since its last step
        self.calls: list[str] = []

    def scale(self, outputs: torch.Tensor) -> torch.Tensor:
        self.calls.append("scale")
        return outputs * self._scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls.append("unscale_")
        found = False
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.div_(self._scale)
                    found = found or not bool(torch.isfinite(param.grad).all())
        self._found_inf[id(optimizer)] = found

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if id(optimizer) not in self._found_inf:  # not unscaled by clipping
            self.unscale_(optimizer)
        self.calls.append("step")
        if self._found_inf[id(optimizer)]:
            return None  # skipped: optimizer.step() not called
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        self.calls.append("update")
        if any(self._found_inf.values()):
            self._scale /= 2
        self._found_inf.clear()

    def get_scale(self) -> float:
        return self._scale

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scale = float(state_dict["scale"])


@attrs.define
class HalvingLossScaleKwargs(KwargsHandler):
    """The test plugin: answers ``make_scaler`` under fp16 (before the built-in handler)."""

    scale: float = 128.0

    @hookimpl
    def make_scaler(self, device_type: str, mixed_precision: str) -> LossScaler | None:
        return HalvingLossScale(self.scale) if mixed_precision == "fp16" else None


def _setup(
    accumulation: int = 1,
) -> tuple[kwplug.Accelerator, HalvingLossScale, torch.nn.Module, Any, list[torch.Tensor]]:
    accelerator = kwplug.Accelerator(
        cpu=True,
        mixed_precision="fp16",
        gradient_accumulation_steps=accumulation,
        kwargs_handlers=[HalvingLossScaleKwargs()],
    )
    backend = accelerator.scaler
    assert isinstance(backend, HalvingLossScale)  # the plugin's answer, not a GradScaler
    model = torch.nn.Linear(3, 1, bias=False)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen: list[torch.Tensor] = []  # the weight gradient each optimizer.step() ran with
    optimizer.optimizer.register_step_pre_hook(
        lambda *_: seen.append(model.weight.grad.detach().clone())
    )
    return accelerator, backend, model, optimizer, seen


def test_the_plugin_rule_drives_backward_step_and_the_scale() -> None:
    accelerator, backend, model, optimizer, seen = _setup()
    x = torch.ones(2, 3)
    true_grad = torch.full((1, 3), 2.0)  # d(sum(x @ w.T)) / dw for two rows of ones
    scales, skipped = [], []
    for factor in (1.0, float("inf"), 1.0, 1.0):
        accelerator.backward(model(x).sum() * factor)
        if factor == 1.0:  # backward scaled by the plugin's scale (128, then 64 -- not 2**16)
            torch.testing.assert_close(model.weight.grad, true_grad * backend.get_scale())
        before = model.weight.detach().clone()
        optimizer.step()
        optimizer.zero_grad()
        skipped.append(accelerator.optimizer_step_was_skipped)
        scales.append(backend.get_scale())
        if skipped[-1]:
            assert torch.equal(model.weight.detach(), before)
    # Halved once after the overflow, never grown.
    assert scales == [128.0, 64.0, 64.0, 64.0]
    assert skipped == [False, True, False, False]
    # The optimizer ran three times, each time on the true (unscaled) gradients.
    assert len(seen) == 3
    for grad in seen:
        torch.testing.assert_close(grad, true_grad)
    assert backend.calls == ["scale", "unscale_", "step", "update"] * 4


def test_clipping_unscales_through_the_plugin_once_per_step() -> None:
    accelerator, backend, model, optimizer, seen = _setup(accumulation=2)
    x = torch.ones(2, 3)
    norms = []
    for _ in range(2):
        with accelerator.accumulate(model):
            accelerator.backward(model(x).sum())
            norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
            optimizer.step()
            optimizer.zero_grad()
    # Partial gradients (1 per weight, divided by 2 micro-batches) are measured unscaled
    # through get_scale(); on the sync step the full ones (2 per weight, norm 2*sqrt(3)).
    assert norms == pytest.approx([3**0.5, 2 * 3**0.5])
    assert backend.calls == ["scale", "scale", "unscale_", "step", "update"]
    torch.testing.assert_close(seen[0], torch.full((1, 3), 1 / 3**0.5))  # clipped to norm 1


def test_the_plugin_state_is_saved_and_loaded(tmp_path: Path) -> None:
    accelerator, backend, model, optimizer, _ = _setup()
    accelerator.backward(model(torch.ones(2, 3)).sum() * float("inf"))
    optimizer.step()
    assert backend.get_scale() == 64.0
    accelerator.save_state(tmp_path / "ckpt")
    resumed, fresh, *_ = _setup()
    assert fresh.get_scale() == 128.0
    resumed.load_state(tmp_path / "ckpt")
    assert fresh.get_scale() == 64.0


def test_an_answer_missing_protocol_methods_fails_at_construction() -> None:
    class ScaleOnly:
        def scale(self, outputs: torch.Tensor) -> torch.Tensor:
            return outputs

    @attrs.define
    class Broken(KwargsHandler):
        @hookimpl
        def make_scaler(self, device_type: str, mixed_precision: str) -> Any:
            return ScaleOnly()

    with pytest.raises(TypeError, match="Broken.*ScaleOnly.*lacks unscale_, step, update"):
        kwplug.Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[Broken()])


def test_the_builtin_answer_is_torchs_grad_scaler_and_a_loss_scaler() -> None:
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="fp16")
    # Accelerate scripts read accelerator.scaler as a torch GradScaler; it is one.
    assert type(accelerator.scaler) is torch.amp.GradScaler
    assert isinstance(accelerator.scaler, LossScaler)

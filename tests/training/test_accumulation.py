"""Gradient accumulation in one process: the Accelerator keywords, accumulate()/sync_gradients,
the no_sync hook, prepared optimizers and schedulers, fp16 clipping and the shared
GradScaler update, and a differential run against Accelerate."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import kwplug
from kwplug.handler import TO_KWARGS
from kwplug.utils import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration


def _loader(batches: int, batch_size: int = 4, features: int = 3) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batches * batch_size, features, generator=generator)
    y = torch.randn(batches * batch_size, 1, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


# -- keywords --------------------------------------------------------------------------------


def test_keywords_are_stored() -> None:
    config = DataLoaderConfiguration(split_batches=True)
    accelerator = kwplug.Accelerator(
        mixed_precision=None,
        cpu=True,
        gradient_accumulation_steps=4,
        dataloader_config=config,
        project_dir="runs/x",
        log_with=["tensorboard"],
        step_scheduler_with_optimizer=False,
    )
    assert accelerator.mixed_precision == "no"
    assert accelerator.gradient_accumulation_steps == 4
    assert accelerator.dataloader_config is config
    assert (accelerator.project_dir, accelerator.logging_dir) == ("runs/x", "runs/x")
    assert accelerator.project_configuration.project_dir == "runs/x"
    assert accelerator.log_with == ["tensorboard"]
    assert accelerator.step_scheduler_with_optimizer is False
    project = ProjectConfiguration(project_dir="p", logging_dir="l")
    accelerator = kwplug.Accelerator(cpu=True, project_config=project, split_batches=True)
    assert accelerator.project_configuration is project and accelerator.logging_dir == "l"
    assert accelerator.dataloader_config.split_batches is True
    assert accelerator.log_with == [] and accelerator.gradient_accumulation_steps == 1


def test_gradient_accumulation_plugin() -> None:
    plugin = GradientAccumulationPlugin(num_steps=3, sync_with_dataloader=False)
    accelerator = kwplug.Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    assert accelerator.gradient_accumulation_steps == 3
    assert not accelerator.gradient_state.sync_with_dataloader
    with pytest.raises(ValueError, match="only one of gradient_accumulation_steps"):
        kwplug.Accelerator(
            cpu=True, gradient_accumulation_plugin=plugin, gradient_accumulation_steps=2
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"gradient_accumulation_steps": 0}, ValueError, "gradient_accumulation_steps"),
        ({"gradient_accumulation_steps": 2.0}, TypeError, "gradient_accumulation_steps"),
        ({"gradient_accumulation_steps": True}, TypeError, "gradient_accumulation_steps"),
        (
            {"gradient_accumulation_plugin": {"num_steps": 2}},
            TypeError,
            "gradient_accumulation_plugin",
        ),
        ({"dataloader_config": {"split_batches": True}}, TypeError, "dataloader_config"),
        ({"project_config": "dir"}, TypeError, "project_config"),
        ({"project_dir": 3}, TypeError, "project_dir"),
        ({"log_with": 3}, TypeError, "log_with"),
        ({"log_with": ["tensorboard", None]}, TypeError, "log_with"),
        ({"step_scheduler_with_optimizer": 1}, TypeError, "step_scheduler_with_optimizer"),
        ({"mixed_precision": "fp8"}, ValueError, "mixed_precision"),
        (
            {"split_batches": True, "dataloader_config": DataLoaderConfiguration()},
            ValueError,
            "split_batches",
        ),
        ({"even_batches": "yes"}, TypeError, "even_batches"),
    ],
)
def test_bad_keyword_is_named(kwargs: dict[str, Any], error: type[Exception], name: str) -> None:
    with pytest.raises(error, match=name):
        kwplug.Accelerator(cpu=True, **kwargs)


# -- accumulate() ----------------------------------------------------------------------------


def test_sync_every_n_and_at_the_end_of_the_loader() -> None:
    accelerator = kwplug.Accelerator(cpu=True, gradient_accumulation_steps=3)
    model = torch.nn.Linear(3, 1)
    loader = accelerator.prepare(_loader(7))
    seen = []
    for _ in range(2):
        for _batch in loader:
            with accelerator.accumulate(model):
                seen.append(accelerator.sync_gradients)
    # The 7th batch ends the loader: a sync step, and the count restarts with the epoch.
    assert seen == [False, False, True, False, False, True, True] * 2
    assert accelerator.sync_gradients and not accelerator.gradient_state.in_dataloader


def test_loader_end_is_not_forced_without_sync_with_dataloader() -> None:
    plugin = GradientAccumulationPlugin(num_steps=3, sync_with_dataloader=False)
    accelerator = kwplug.Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    loader = accelerator.prepare(_loader(4))
    seen = []
    for _batch in loader:
        with accelerator.accumulate():
            seen.append(accelerator.sync_gradients)
    assert seen == [False, False, True, False]


def test_gradient_state_round_trip() -> None:
    accelerator = kwplug.Accelerator(cpu=True, gradient_accumulation_steps=3)
    with accelerator.accumulate():
        pass
    saved = accelerator.gradient_state.state_dict()
    assert saved == {"step": 1, "sync_gradients": False}
    resumed = kwplug.Accelerator(cpu=True, gradient_accumulation_steps=3)
    resumed.gradient_state.load_state_dict(saved)
    seen = []
    for _ in range(2):
        with resumed.accumulate():
            seen.append(resumed.sync_gradients)
    assert seen == [False, True]
    accelerator.gradient_state.restart()
    assert accelerator.gradient_state.step == 0


def test_nested_loaders_end_of_dataloader() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    outer, inner = accelerator.prepare(_loader(2), _loader(2))
    state = accelerator.gradient_state
    flags = []
    for _ in outer:
        flags.append(("outer", state.end_of_dataloader))
        for _ in inner:
            flags.append(("inner", state.end_of_dataloader))
        flags.append(("outer", state.end_of_dataloader))
    assert flags == [
        ("outer", False), ("inner", False), ("inner", True), ("outer", False),
        ("outer", True), ("inner", False), ("inner", True), ("outer", True),
    ]  # fmt: skip
    assert not state.in_dataloader


def test_setting_gradient_accumulation_steps_takes_effect() -> None:
    accelerator = kwplug.Accelerator(cpu=True, gradient_accumulation_steps=2)
    seen = []
    for steps in (2, 2, 4, 4, 4, 4):
        accelerator.gradient_accumulation_steps = steps
        with accelerator.accumulate():
            seen.append(accelerator.sync_gradients)
    # As Accelerate: the micro-batch count runs on (only a loader's end restarts it), and the
    # new number applies to it from the next entry: micro-batch 4 is 4 % 4 == 0.
    assert seen == [False, True, False, True, False, False]
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        accelerator.gradient_accumulation_steps = 0


def _train(accelerator: kwplug.Accelerator, batch_size: int, clip: bool = False) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = model.double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    loader = DataLoader(
        TensorDataset(*(t.double() for t in _loader(12).dataset.tensors)), batch_size=batch_size
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if clip and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return model, optimizer, scheduler


@pytest.mark.parametrize("clip", [False, True])
def test_accumulated_training_equals_full_batch_training(clip: bool) -> None:
    # 4 micro-batches of 4, each loss / 4, sum to the mean loss of the batch of 16. float64:
    # only the summation order differs (per micro-batch, then across), a few ulps of 1e-16
    # relative per step, so rtol=1e-12 leaves a wide margin over 3 steps and fails on any
    # missing division or extra step (those change weights at 1e-2 relative).
    acc = _train(kwplug.Accelerator(cpu=True, gradient_accumulation_steps=4), 4, clip)
    ref = _train(kwplug.Accelerator(cpu=True), 16, clip)
    for ours, theirs in zip(acc[0].parameters(), ref[0].parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    assert acc[1].state_dict()["state"][0]["momentum_buffer"] is not None
    assert acc[2].state_dict() == ref[2].state_dict()  # 3 scheduler steps each
    assert acc[2].last_epoch == 3


def test_optimizer_and_scheduler_skip_accumulation_steps() -> None:
    accelerator = kwplug.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    steps = []
    optimizer.optimizer.register_step_post_hook(lambda *_: steps.append(1))
    assert scheduler in accelerator._checkpoint_sources().custom_objects  # saved by save_state
    for _ in range(5):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(2, 3)).sum())
            grad = model.weight.grad.clone()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if not accelerator.sync_gradients:  # neither stepped nor zeroed
                assert torch.equal(model.weight.grad, grad)
    assert len(steps) == 2 and scheduler.last_epoch == 2
    assert scheduler.scheduler._step_count == 3  # adjust_scheduler not given: as Accelerate


def test_adjust_scheduler_behaves_as_accelerates() -> None:
    # Accelerate reads the plugin through to_kwargs(), which drops fields equal to their
    # default; adjust_scheduler=True is the default, so it never adds accumulation steps to
    # _step_count (accelerate 1.15). kwplug keeps that, so checkpoints hold the same state.
    plugin = GradientAccumulationPlugin(num_steps=2, adjust_scheduler=True)
    accelerator = kwplug.Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    optimizer, scheduler = accelerator.prepare(
        optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1)
    )
    for _ in range(4):
        with accelerator.accumulate():
            optimizer.step()
            scheduler.step()
    assert not accelerator.gradient_state.adjust_scheduler
    assert scheduler.last_epoch == 2 and scheduler.scheduler._step_count == 3


# The scheduler steps on micro-batches where the optimizer did not: torch warns, as intended.
@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")
def test_step_scheduler_without_optimizer() -> None:
    accelerator = kwplug.Accelerator(
        cpu=True, gradient_accumulation_steps=2, step_scheduler_with_optimizer=False
    )
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    optimizer, scheduler = accelerator.prepare(
        optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1)
    )
    for _ in range(3):
        with accelerator.accumulate():
            optimizer.step()
            scheduler.step()
    assert scheduler.last_epoch == 3


# -- the no_sync hook ------------------------------------------------------------------------


@attrs.define
class _Recorder(kwplug.KwargsHandler):
    """Answers no_sync for one model with a context that counts its entries."""

    model: torch.nn.Module | None = attrs.field(default=None, metadata={TO_KWARGS: False})
    entered: int = attrs.field(default=0, metadata={TO_KWARGS: False})

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        self.entered += 1
        yield

    @kwplug.hookimpl
    def no_sync(self, model: torch.nn.Module) -> Any:
        return self._context() if model is self.model else None


def test_hook_no_sync() -> None:
    model, other = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    recorder = _Recorder(model)
    accelerator = kwplug.Accelerator(
        cpu=True, gradient_accumulation_steps=3, kwargs_handlers=[recorder]
    )
    for _ in range(6):
        with accelerator.accumulate(model):
            pass
    assert recorder.entered == 4  # the non-sync micro-batches only
    assert accelerator.plan["no_sync"].plugin is not None
    # Not the recorder's model: it falls through to the built-in DDP handler (not a DDP
    # model: None), and nobody answering means nullcontext.
    assert isinstance(accelerator.no_sync(other), contextlib.nullcontext)
    assert accelerator.plan["no_sync"].result is None
    # gradient_accumulation_steps=1: never called.
    single = kwplug.Accelerator(cpu=True, kwargs_handlers=[_Recorder(model)])
    with single.accumulate(model):
        pass
    assert "no_sync" not in single.plan


# -- fp16: clipping and the GradScaler -------------------------------------------------------


def test_fp16_clip_unscales_once_and_only_on_sync_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # The prepared forward runs in float16: torch's default initial scale (2**16) would overflow
    # these float16 gradients (2 and 4 per weight) and skip the steps, so start lower.
    accelerator = kwplug.Accelerator(
        cpu=True,
        mixed_precision="fp16",
        gradient_accumulation_steps=2,
        kwargs_handlers=[kwplug.GradScalerKwargs(init_scale=1024.0)],
    )
    scaler = accelerator.scaler
    assert scaler is not None
    calls = []
    unscale = scaler.unscale_
    monkeypatch.setattr(scaler, "unscale_", lambda opt: (calls.append(opt), unscale(opt)))
    model = torch.nn.Linear(3, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(4):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(2, 3)).sum())
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # a second call: no unscale
            accelerator.clip_grad_value_(model.parameters(), 1.0)
            # The norm is of the unscaled gradients, partial ones included.
            assert norm.item() == pytest.approx(((step % 2) + 1) * 2.0, rel=1e-3)
            optimizer.step()
            optimizer.zero_grad()
    assert len(calls) == 2  # one per optimizer step
    assert not accelerator.optimizer_step_was_skipped


def _two_optimizers(accelerator: kwplug.Accelerator) -> tuple[Any, ...]:
    first, second = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    optimizers = accelerator.prepare(
        torch.optim.SGD(first.parameters(), lr=0.1), torch.optim.SGD(second.parameters(), lr=0.1)
    )
    return (first, second, *optimizers)


def test_two_optimizers_update_the_scaler_once_per_step() -> None:
    handler = kwplug.GradScalerKwargs(init_scale=1024.0, growth_interval=1, growth_factor=2.0)
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[handler])
    scaler = accelerator.scaler
    assert scaler is not None
    first, second, opt1, opt2 = _two_optimizers(accelerator)
    x = torch.ones(1, 2)
    accelerator.backward(first(x).sum() + second(x).sum())
    expected = second.weight.grad / 1024.0 * 0.1
    before = second.weight.detach().clone()
    opt1.step()
    opt2.step()
    # One clean step grows the scale once (updating per optimizer grew it 4x and unscaled
    # the second optimizer's gradients with the grown scale).
    assert scaler.get_scale() == 2048.0
    torch.testing.assert_close(before - second.weight.detach(), expected)
    # An overflow in one optimizer: that one skips, the back-off is kept.
    accelerator.backward(first(x).sum() * float("inf") + second(x).sum())
    opt1.step()
    opt2.step()
    assert scaler.get_scale() == 1024.0
    assert opt1.step_was_skipped and not opt2.step_was_skipped
    assert accelerator.optimizer_step_was_skipped


def test_alternating_optimizers_update_at_the_next_backward() -> None:
    handler = kwplug.GradScalerKwargs(init_scale=1024.0, growth_interval=1)
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[handler])
    first, _, opt1, _ = _two_optimizers(accelerator)
    x = torch.ones(1, 2)
    for _ in range(3):  # only the first optimizer steps (a GAN's alternation)
        accelerator.backward(first(x).sum())
        opt1.step()
        opt1.zero_grad()
    accelerator.backward(first(x).sum())
    assert accelerator.scaler is not None and accelerator.scaler.get_scale() == 1024.0 * 8


# -- differential: Accelerate ----------------------------------------------------------------


def _accelerate_loop(accelerator: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    loader = _loader(10)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    syncs = []
    for _epoch in range(2):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                syncs.append(accelerator.sync_gradients)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    return {
        "weights": {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "syncs": syncs,
    }


def test_accumulate_matches_accelerate_bitwise() -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        theirs = _accelerate_loop(accelerate.Accelerator(cpu=True, gradient_accumulation_steps=3))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    ours = _accelerate_loop(kwplug.Accelerator(cpu=True, gradient_accumulation_steps=3))
    assert ours["syncs"] == theirs["syncs"]
    assert ours["syncs"].count(True) == 8  # 3 full groups + the loader's end, per epoch
    for key, value in theirs["weights"].items():
        assert torch.equal(ours["weights"][key], value), key
    assert ours["scheduler"] == theirs["scheduler"]
    for index, state in theirs["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(ours["optimizer"]["state"][index][name], value), name

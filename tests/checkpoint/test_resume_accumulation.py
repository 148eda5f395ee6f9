"""save_state in the middle of a gradient accumulation, load_state in a fresh process: the
run continues bitwise as if it had never stopped (1 and 2 processes, DDP, fp16 GradScaler
with clipping)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from kwplug.testing import run_distributed

STEPS = 4  # micro-batches per optimizer step
MICRO = 3  # samples per rank per micro-batch
BATCHES = 10  # micro-batches per rank: windows of 4, 4 and 2 (the loader's end syncs)
BOUNDARY, MIDDLE = 4, 6  # saved after a synchronising step / after 2 of 4 micro-batches
CONFIGS = ("fp32", "fp16+clip")


def _accelerator(config: str) -> Any:
    import kwplug

    handlers = []
    if config.startswith("fp16"):
        # Growth after every clean step from a scale near overflow: the run steps, skips a
        # step on inf gradients and backs off (checked below), so the scaler's state matters.
        handlers.append(kwplug.GradScalerKwargs(init_scale=2.0**15, growth_interval=1))
    return kwplug.Accelerator(
        mixed_precision="fp16" if config.startswith("fp16") else "no",
        cpu=True,
        gradient_accumulation_steps=STEPS,
        kwargs_handlers=handlers,
    )


def _prepared(config: str, resume_from: Path | None = None) -> tuple[Any, ...]:
    accelerator = _accelerator(config)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    generator = torch.Generator().manual_seed(1)
    samples = BATCHES * MICRO * accelerator.num_processes
    data = TensorDataset(
        torch.randn(samples, 6, generator=generator) * 30,
        torch.randn(samples, 1, generator=generator),
    )
    loader = DataLoader(data, batch_size=MICRO, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if resume_from is not None:
        accelerator.load_state(resume_from, exact_data_position=True)
    # One iterator for the epoch (a new `for` over the loader would start a new epoch).
    return accelerator, model, optimizer, iter(loader), scheduler


def _train(prepared: tuple[Any, ...], stop: int | None = None) -> list[bool]:
    """Train on the epoch's batches left, up to micro-batch ``stop`` of this call; return
    for each micro-batch whether it ended with a skipped optimizer step (fp16 overflow)."""
    accelerator, model, optimizer, batches, scheduler = prepared
    seen: list[bool] = []
    for x, y in batches:
        with accelerator.accumulate(model):
            with accelerator.autocast():
                loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients and accelerator.mixed_precision == "fp16":
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        seen.append(accelerator.sync_gradients and accelerator.optimizer_step_was_skipped)
        if len(seen) == stop:
            break
    return seen


def _weights(prepared: tuple[Any, ...]) -> list[torch.Tensor]:
    accelerator, model = prepared[:2]
    return [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]


def _files(version_dir: Path) -> list[str]:
    return sorted(p.name for p in version_dir.iterdir())


def interrupted_worker(directory: str) -> dict[str, Any]:
    """Each rank: the uninterrupted run, then a run saved at a boundary and mid-window."""
    results: dict[str, Any] = {}
    for config in CONFIGS:
        full = _prepared(config)
        skipped = _train(full)
        run = _prepared(config)
        _train(run, stop=BOUNDARY)
        boundary = run[0].save_state(Path(directory, config, "boundary"))
        _train(run, stop=MIDDLE - BOUNDARY)
        grads = [p.grad.clone() for p in run[0].unwrap_model(run[1]).parameters()]
        middle = run[0].save_state(Path(directory, config, "middle"))
        results[config] = {
            "weights": _weights(full),
            "skipped": skipped,
            "grads": grads,
            "step": run[0].gradient_state.step,
            "boundary_files": _files(next(boundary.glob("kwplug-*"))),
            "middle_files": _files(next(middle.glob("kwplug-*"))),
        }
    return results


def resumed_worker(directory: str) -> dict[str, Any]:
    """Each rank, in a fresh process: load the mid-window checkpoint and finish the run."""
    results: dict[str, Any] = {}
    for config in CONFIGS:
        run = _prepared(config, resume_from=Path(directory, config, "middle"))
        grads = [p.grad.clone() for p in run[0].unwrap_model(run[1]).parameters()]
        state = run[0].gradient_state.state_dict()
        seen = _train(run)
        results[config] = {"weights": _weights(run), "grads": grads, "state": state, "seen": seen}
    return results


@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_mid_accumulation_is_bitwise_exact(tmp_path: Path, nproc: int) -> None:
    before = run_distributed(interrupted_worker, str(tmp_path), nproc=nproc, timeout=240)
    after = run_distributed(resumed_worker, str(tmp_path), nproc=nproc, timeout=240)
    ranks = [f"rank_{r}.safetensors" for r in range(nproc)]
    pending = [f"accumulation_{r}.safetensors" for r in range(nproc)]
    for rank, (saved, resumed) in enumerate(zip(before, after, strict=True)):
        for config in CONFIGS:
            ours, theirs = saved[config], resumed[config]
            # A save at a boundary writes nothing extra; a save mid-window every rank's grads.
            assert not any(f.startswith("accumulation_") for f in ours["boundary_files"])
            assert set(ranks + pending) <= set(ours["middle_files"])
            assert ours["step"] == MIDDLE
            assert theirs["state"] == {"step": MIDDLE, "sync_gradients": False}
            assert len(theirs["seen"]) == BATCHES - MIDDLE
            assert theirs["seen"] == ours["skipped"][MIDDLE:]
            for a, b in zip(ours["grads"], theirs["grads"], strict=True):
                assert torch.equal(a, b), (rank, config)
            for a, b in zip(ours["weights"], theirs["weights"], strict=True):
                assert torch.equal(a, b), (rank, config)
        # fp16: the first step is taken (the scale grows), a later one skipped (it backs off).
        skipped = before[rank]["fp16+clip"]["skipped"]
        assert skipped[BOUNDARY - 1] is False and any(skipped[MIDDLE:])
    if nproc == 2:  # the ranks' local grads differ before the synchronising step
        assert not torch.equal(before[0]["fp32"]["grads"][0], before[1]["fp32"]["grads"][0])


def test_a_boundary_checkpoint_restarts_the_count(tmp_path: Path) -> None:
    run = _prepared("fp32")
    _train(run, stop=BOUNDARY)
    run[0].save_state(tmp_path / "boundary")
    _train(run, stop=2)
    assert run[0].gradient_state.state_dict() == {"step": MIDDLE, "sync_gradients": False}
    run[0].load_state(tmp_path / "boundary")  # no accumulation file in it
    assert run[0].gradient_state.state_dict() == {"step": 0, "sync_gradients": True}


def _alternating(tmp_path: Path, save: bool) -> float:
    import kwplug

    handler = kwplug.GradScalerKwargs(init_scale=1024.0, growth_interval=1)
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[handler])
    torch.manual_seed(0)
    first, second = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    opt1, _ = accelerator.prepare(
        torch.optim.SGD(first.parameters(), lr=0.1), torch.optim.SGD(second.parameters(), lr=0.1)
    )
    if save:  # only the first optimizer steps: an update is owed
        accelerator.backward(first(torch.ones(1, 2)).sum())
        opt1.step()
        opt1.zero_grad()
        accelerator.save_state(tmp_path)
    else:  # a fresh Accelerator resuming from the checkpoint
        accelerator.load_state(tmp_path)
    accelerator.backward(first(torch.ones(1, 2)).sum())  # makes the owed update, if any
    assert accelerator.scaler is not None
    return accelerator.scaler.get_scale()


def test_the_scaler_update_owed_to_the_last_step_is_saved(tmp_path: Path) -> None:
    # One optimizer of two stepped: GradScaler.update() waits for the next backward. The save
    # makes it, so the resumed scaler has the scale the uninterrupted run goes on with.
    assert _alternating(tmp_path, save=True) == _alternating(tmp_path, save=False) == 2048.0

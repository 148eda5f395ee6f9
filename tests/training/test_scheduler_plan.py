"""``AcceleratedScheduler.step`` precomputes what it checks each step (issue 31, goal 2): the
learning rates it produces stay those of the rules it documents, attributes assigned after
construction still take effect, and OneCycleLR still stops at ``total_steps``."""

from __future__ import annotations

import attrs
import pytest
import torch

from kwplug.optimizer import AcceleratedOptimizer
from kwplug.scheduler import AcceleratedScheduler


@attrs.define
class Sync:
    sync_gradients: bool = True
    adjust_scheduler: bool = False


def make(
    total: int | None = None, **kwargs: object
) -> tuple[AcceleratedScheduler, torch.optim.Optimizer, Sync]:
    params = [torch.nn.Parameter(torch.ones(2))]
    optimizer = torch.optim.SGD(params, lr=1.0)
    state = Sync()
    prepared = AcceleratedOptimizer(optimizer, gradient_state=state)
    if total is None:
        scheduler: torch.optim.lr_scheduler.LRScheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: 1.0 / (1 + step)
        )
    else:
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=total)
    wrapped = AcceleratedScheduler(scheduler, [prepared], state, **kwargs)  # type: ignore[arg-type]
    return wrapped, optimizer, state


def lr(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def test_num_processes_steps_and_a_later_assignment_takes_effect() -> None:
    wrapped, optimizer, _ = make(num_processes=2)
    optimizer.step()
    wrapped.step()
    assert wrapped.scheduler._step_count == 3  # two scheduler steps per optimizer step
    assert lr(optimizer) == pytest.approx(1.0 / 3)
    wrapped.num_processes = 1  # assigned after the first step: the next step follows it
    wrapped.step()
    assert wrapped.scheduler._step_count == 4
    wrapped.split_batches = True
    wrapped.num_processes = 4
    wrapped.step()
    assert wrapped.scheduler._step_count == 5
    wrapped.step_with_optimizer = False
    wrapped.gradient_state = Sync(sync_gradients=False)
    wrapped.step()  # every call steps now, accumulating or not
    assert wrapped.scheduler._step_count == 6


def test_accumulating_steps_skip_or_count() -> None:
    wrapped, _, state = make()
    state.sync_gradients = False
    wrapped.step()
    assert wrapped.scheduler._step_count == 1
    state.adjust_scheduler = True
    wrapped.step()
    assert wrapped.scheduler._step_count == 2


def test_one_cycle_stops_at_total_steps() -> None:
    wrapped, optimizer, _ = make(total=3)
    for _ in range(6):  # torch's OneCycleLR raises past total_steps; the wrapper stops
        optimizer.step()
        wrapped.step()
    assert wrapped.scheduler._step_count == 4


def test_a_skipped_step_of_a_scaled_optimizer_skips_the_scheduler() -> None:
    wrapped, _, _ = make()
    skipping = wrapped.optimizers[0]
    scaler = torch.amp.GradScaler("cpu")
    scaled = AcceleratedOptimizer(skipping.optimizer, scaler=scaler, gradient_state=Sync())
    wrapped.optimizers = [scaled]
    scaled._is_overflow = True  # what GradScaler's skipped step leaves
    wrapped.step()
    assert wrapped.scheduler._step_count == 1
    scaled._is_overflow = False
    wrapped.step()
    assert wrapped.scheduler._step_count == 2


class DictWatchingLR(torch.optim.lr_scheduler.LambdaLR):
    """A LambdaLR counting reads of its instance ``__dict__`` (attribute access itself does
    not go through that descriptor)."""

    dict_reads = 0

    @property  # type: ignore[misc]
    def __dict__(self) -> dict[str, object]:  # type: ignore[override]
        type(self).dict_reads += 1
        return object.__getattribute__(self, "__dict__")  # type: ignore[no-any-return]


def test_step_never_reads_the_scheduler_instance_dict() -> None:
    # Reading an instance's __dict__ makes CPython replace its inline attribute values with a
    # dict, and every attribute access of torch's own step() then costs more (~4,000
    # instructions per step; python -m benchmarks instructions).
    params = [torch.nn.Parameter(torch.ones(2))]
    optimizer = torch.optim.SGD(params, lr=1.0)
    state = Sync()
    scheduler = DictWatchingLR(optimizer, lambda step: 1.0 / (1 + step))
    DictWatchingLR.dict_reads = 0
    wrapped = AcceleratedScheduler(scheduler, [AcceleratedOptimizer(optimizer)], state)  # type: ignore[arg-type]
    for _ in range(5):
        optimizer.step()
        wrapped.step()
    assert scheduler._step_count == 6
    assert lr(optimizer) == pytest.approx(1.0 / 6)
    assert DictWatchingLR.dict_reads == 0

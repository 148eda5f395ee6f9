"""kwplug.local_sgd.LocalSGD: parameters averaged every N steps, drifting in between."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kwplug import Accelerator
from kwplug.local_sgd import LocalSGD
from kwplug.testing import run_distributed

STEPS, EVERY = 7, 3


def _train(accelerator: Any, local_sgd_class: Any, rank: int) -> list[torch.Tensor]:
    """Train a seeded model on rank-specific data; the flat parameters after every step, then
    after leaving the LocalSGD block."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(100 + rank)
    trajectory = []
    with local_sgd_class(accelerator, model, local_sgd_steps=EVERY) as local_sgd:
        for _ in range(STEPS):
            x = torch.randn(8, 4, generator=generator)
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            local_sgd.step()
            trajectory.append(_flat(model))
    trajectory.append(_flat(model))
    return trajectory


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def local_sgd_in_both_libraries() -> dict[str, list[torch.Tensor]]:
    import torch.distributed as dist
    from accelerate import Accelerator as AccelerateAccelerator
    from accelerate.local_sgd import LocalSGD as AccelerateLocalSGD

    accelerator = Accelerator(cpu=True)
    ours = _train(accelerator, LocalSGD, accelerator.process_index)
    theirs = _train(AccelerateAccelerator(cpu=True), AccelerateLocalSGD, accelerator.process_index)
    dist.barrier()
    return {"kwplug": ours, "accelerate": theirs}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, list[torch.Tensor]]]:
    return run_distributed(local_sgd_in_both_libraries, nproc=2, timeout=300)


def test_parameters_are_averaged_every_n_steps(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = (r["kwplug"] for r in ranks)
    equal = [torch.equal(a, b) for a, b in zip(rank0, rank1, strict=True)]
    # After steps 3 and 6 and on leaving the block: averaged. Otherwise each rank trains on its
    # own data without gradient synchronisation, so the ranks differ.
    assert equal == [False, False, True, False, False, True, False, True]
    mean = (rank0[1] + rank1[1]) / 2
    assert not torch.equal(rank0[2], mean)  # step 3 trains first, then averages


def test_same_trajectory_as_accelerates_local_sgd(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        for ours, theirs in zip(result["kwplug"], result["accelerate"], strict=True):
            assert torch.equal(ours, theirs)


def test_one_process_is_a_counting_no_op() -> None:
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    before = _flat(model)
    with LocalSGD(accelerator, model, local_sgd_steps=1) as local_sgd:
        local_sgd.step()
        local_sgd.step()
    assert not local_sgd.enabled and local_sgd.num_steps == 2
    assert torch.equal(_flat(model), before)
    # Disabled, the step count is not checked (Accelerate's example passes None then).
    LocalSGD(accelerator, model, local_sgd_steps=None, enabled=False)  # type: ignore[arg-type]


class _FakeAccelerator:
    def __init__(self, distributed_type: str | None = None) -> None:
        self.distributed = True
        self.num_processes = 2
        if distributed_type is not None:
            self.distributed_type = distributed_type
        self.entered: list[str] = []

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        self.entered.append("enter")
        try:
            yield
        finally:
            self.entered.append("exit")

    def wait_for_everyone(self) -> None:
        raise AssertionError("no averaging after an error")


def test_uses_accelerator_no_sync_and_skips_averaging_after_an_error() -> None:
    accelerator = _FakeAccelerator()
    with pytest.raises(KeyError), LocalSGD(accelerator, torch.nn.Linear(2, 1), 2):
        assert accelerator.entered == ["enter"]
        raise KeyError
    assert accelerator.entered == ["enter", "exit"]


@pytest.mark.parametrize(("steps", "error"), [(0, ValueError), (2.0, TypeError), (True, TypeError)])
def test_invalid_step_count(steps: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="local_sgd_steps"):
        LocalSGD(_FakeAccelerator(), torch.nn.Linear(2, 1), steps)


def test_sharded_setups_are_refused() -> None:
    from kwplug.utils import DistributedType

    for kind in (DistributedType.FSDP, "DEEPSPEED"):
        with pytest.raises(NotImplementedError, match="distributed_type"):
            LocalSGD(_FakeAccelerator(kind), torch.nn.Linear(2, 1), 2)

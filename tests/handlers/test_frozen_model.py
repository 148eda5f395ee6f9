"""Issue 21: a model without trainable parameters (a frozen distillation teacher) prepared in 2
processes is placed on the device unwrapped, with a FrozenModelWarning naming it, instead of
torch's raw DDP error; the student next to it is wrapped and trains as usual."""

from __future__ import annotations

import warnings
from typing import Any

import torch

import kwplug
from kwplug.errors import FrozenModelWarning
from kwplug.testing import run_distributed


class Teacher(torch.nn.Module):
    """A frozen reference model."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def distil() -> dict[str, Any]:
    """Rank body: prepare a frozen teacher and a student, train the student two steps."""
    torch.manual_seed(0)
    accelerator = kwplug.Accelerator(cpu=True)
    teacher, student = Teacher(), torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        teacher, student, optimizer = accelerator.prepare(teacher, student, optimizer)
    x = torch.randn(8, 4) + accelerator.process_index
    for _ in range(2):
        with torch.no_grad():
            target = teacher(x)
        loss = torch.nn.functional.mse_loss(student(x), target)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    frozen = [w for w in caught if issubclass(w.category, FrozenModelWarning)]
    weights = accelerator.unwrap_model(student).weight.detach().clone()
    gathered = accelerator.gather(weights[None])
    result = {
        "teacher": type(teacher).__name__,
        "student": type(student).__name__,
        "warnings": [(str(w.message), w.message.model, w.filename) for w in frozen],
        "same_student": bool(torch.equal(gathered[0], gathered[1])),
        "device": str(next(teacher.parameters()).device),
    }
    accelerator.end_training()
    return result


def test_frozen_model_is_placed_unwrapped_with_a_warning() -> None:
    results = run_distributed(distil, nproc=2, timeout=180)
    for result in results:
        assert result["teacher"] == "Teacher" and result["student"] == "DistributedDataParallel"
        assert result["same_student"] and result["device"] == "cpu"
        ((message, model, filename),) = result["warnings"]
        assert model == "Teacher" and "'Teacher' has no trainable parameters" in message
        assert "evaluation_mode=True" in message
        assert filename == __file__  # points at the prepare() line


def test_single_process_frozen_model_needs_no_warning() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FrozenModelWarning)
        teacher = accelerator.prepare(Teacher())
    assert isinstance(teacher, Teacher)

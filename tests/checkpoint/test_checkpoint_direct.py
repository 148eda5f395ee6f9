"""Loads read straight into the live tensors (issue 31, goal 1; ``kwplug.checkpoint._direct``):
the same values as a load from a private copy, in the parameters' and optimizer state's own
memory, and objects whose loading runs code of their own still loaded through it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import kwplug
from kwplug.checkpoint import _direct as direct

MIB = 1 << 20


class Tied(torch.nn.Module):
    """An embedding and a head sharing one weight (as language models tie them)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.norm = torch.nn.BatchNorm1d(32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


class Transposed(torch.nn.Linear):
    """A layer storing its weight transposed: its own ``_load_from_state_dict``."""

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = destination[prefix + "weight"].t().contiguous()

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"].t()
        super()._load_from_state_dict(state_dict, prefix, *args)


def _train(model: torch.nn.Module, optimizer_name: str) -> tuple[kwplug.Accelerator, Any, Any]:
    accelerator = kwplug.Accelerator(cpu=True)
    optimizer: torch.optim.Optimizer
    if optimizer_name == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(2):
        ids = torch.randint(0, 64, (8,))
        model(ids).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return accelerator, model, optimizer


def _snapshot(model: torch.nn.Module, optimizer: Any) -> tuple[dict[str, Any], list[Any]]:
    params = {k: v.clone() for k, v in model.state_dict().items()}
    states = [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for s in optimizer.optimizer.state.values()
    ]
    return params, states


def _scramble(model: torch.nn.Module, optimizer: Any) -> None:
    with torch.no_grad():
        for value in model.state_dict().values():
            value.fill_(7) if value.is_floating_point() else value.zero_()
        for state in optimizer.optimizer.state.values():
            for value in state.values():
                value.fill_(3)


def _same(model: torch.nn.Module, optimizer: Any, saved: tuple[dict[str, Any], list[Any]]) -> None:
    params, states = saved
    for key, value in model.state_dict().items():
        assert value.dtype == params[key].dtype and torch.equal(value, params[key]), key
    now = list(optimizer.optimizer.state.values())
    assert len(now) == len(states)
    for live, expected in zip(now, states, strict=True):
        assert live.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(live[key], value), key


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_a_load_into_live_state_is_exact_and_makes_no_memory(
    tmp_path: Path, optimizer_name: str
) -> None:
    torch.manual_seed(0)
    accelerator, model, optimizer = _train(Tied(), optimizer_name)
    assert direct.live_state(model) is not None and direct.live_state(optimizer) is not None
    accelerator.save_state(tmp_path / "ckpt")
    saved = _snapshot(model, optimizer)
    pointers = {k: v.data_ptr() for k, v in model.state_dict().items()}
    state_objects = [dict(s) for s in optimizer.optimizer.state.values()]
    _scramble(model, optimizer)
    accelerator.load_state(tmp_path / "ckpt")
    _same(model, optimizer, saved)
    assert model.head.weight is model.embed.weight  # still tied
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == pointers
    for before, after in zip(state_objects, optimizer.optimizer.state.values(), strict=True):
        for key, value in before.items():
            assert after[key] is value, key


def test_a_fresh_run_resumes_exactly(tmp_path: Path) -> None:
    # A new process's optimizer has no state yet: its file goes through the private copy,
    # the model's straight into the parameters; the next step is bitwise that of the run.
    torch.manual_seed(0)
    accelerator, model, optimizer = _train(Tied(), "adam")
    accelerator.save_state(tmp_path / "ckpt")
    torch.manual_seed(1)
    fresh = Tied()
    fresh_accelerator = kwplug.Accelerator(cpu=True)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh, fresh_optimizer = fresh_accelerator.prepare(fresh, fresh_optimizer)
    assert direct.live_state(fresh_optimizer) is None  # no state to read into
    fresh_accelerator.load_state(tmp_path / "ckpt")
    ids = torch.randint(0, 64, (8,))
    for run, opt in ((model, optimizer), (fresh, fresh_optimizer)):
        run(ids).pow(2).mean().backward()
        opt.step()
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_a_module_loading_with_its_own_code_is_loaded_through_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(Transposed(16, 8), torch.nn.Linear(8, 8))
    accelerator = kwplug.Accelerator(cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert direct.live_state(model) is None
    accelerator.save_state(tmp_path / "ckpt")
    weight = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.zero_()
    accelerator.load_state(tmp_path / "ckpt")
    assert torch.equal(model[0].weight, weight)


def test_optimizer_hooks_send_the_load_through_a_private_copy(tmp_path: Path) -> None:
    torch.manual_seed(0)
    accelerator, model, optimizer = _train(Tied(), "adam")
    seen: list[int] = []
    optimizer.optimizer.register_load_state_dict_post_hook(lambda *_: seen.append(1))
    assert direct.live_state(optimizer) is None
    accelerator.save_state(tmp_path / "ckpt")
    saved = _snapshot(model, optimizer)
    _scramble(model, optimizer)
    accelerator.load_state(tmp_path / "ckpt")
    _same(model, optimizer, saved)
    assert seen == [1]


def test_files_read_into_live_tensors_are_read_two_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    accelerator, model, optimizer = _train(Tied(), "adam")
    accelerator.save_state(tmp_path / "ckpt")
    saved = _snapshot(model, optimizer)
    real = direct.read_into
    started: list[str] = []
    both = threading.Event()
    lock = threading.Lock()

    def meeting(path: Path, expected: Any, live: Any) -> Any:
        with lock:
            started.append(threading.current_thread().name)
            if len(started) == 2:
                both.set()
        both.wait(timeout=10)  # the other file's read runs meanwhile
        return real(path, expected, live)

    monkeypatch.setattr(direct, "read_into", meeting)
    _scramble(model, optimizer)
    accelerator.load_state(tmp_path / "ckpt")
    assert both.is_set() and all(n.startswith("kwplug-load") for n in started)
    _same(model, optimizer, saved)

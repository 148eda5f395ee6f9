"""A load's private buffers (issue 31, goal 1): the model's buffer, once its tensors are
copied into the parameters, is read into again by the optimizer's file (no new memory made),
and never while anything still holds what was decoded from it. Private buffers are what a
load reads into where it cannot read into the live tensors (``_direct``): a model whose
loading runs code of its own, an optimizer with no state yet (as in a new process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import kwplug
from kwplug.checkpoint import _staging as staging

WIDTH = 1024  # a 4 MiB weight: files over staging.HUGE, so the load reuses buffers


class Keeping(torch.nn.Sequential):
    """A model whose ``load_state_dict`` keeps the state dict it was given (as a user's
    override or hook might): what it keeps must stay the checkpoint's values."""

    kept: dict[str, torch.Tensor]

    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        self.kept = dict(state_dict)
        return super().load_state_dict(state_dict, *args, **kwargs)


def _setup(model: torch.nn.Module) -> tuple[kwplug.Accelerator, Any, Any]:
    torch.manual_seed(0)
    accelerator = kwplug.Accelerator(cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(2, WIDTH)).sum().backward()
    optimizer.step()
    return accelerator, model, optimizer


def _made(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    # The sizes of the buffers of at least staging.HUGE bytes made (each a new mapping).
    sizes: list[int] = []
    real = staging._Buffer.__init__

    def counting(self: Any, size: int) -> None:
        real(self, size)
        if size >= staging.HUGE:
            sizes.append(size)

    monkeypatch.setattr(staging._Buffer, "__init__", counting)
    return sizes


def _saved(model: torch.nn.Module, optimizer: Any) -> tuple[dict[str, Any], list[Any]]:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    momenta = [s["momentum_buffer"].clone() for s in optimizer.optimizer.state.values()]
    return state, momenta


def test_the_optimizer_is_read_into_the_models_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    accelerator, model, optimizer = _setup(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH)))
    hooked: list[int] = []
    model.register_load_state_dict_post_hook(lambda *_: hooked.append(1))  # a private copy
    accelerator.save_state(tmp_path / "ckpt")
    weights, momenta = _saved(model, optimizer)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    optimizer.optimizer.state.clear()  # no state yet: its file goes to a private copy too
    made = _made(monkeypatch)
    accelerator.load_state(tmp_path / "ckpt")
    assert len(made) == 1, made  # one buffer for both files (the model's, then reused)
    assert hooked == [1]
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]), key
    loaded = [s["momentum_buffer"] for s in optimizer.optimizer.state.values()]
    for got, want in zip(loaded, momenta, strict=True):
        assert torch.equal(got, want)
    # The weight's momentum is a view of that one buffer: no copy of the file was made.
    storage = loaded[0].untyped_storage()
    assert storage.nbytes() >= made[0] >= WIDTH * WIDTH * 4


def test_a_buffer_still_referenced_is_never_read_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    accelerator, model, optimizer = _setup(Keeping(torch.nn.Linear(WIDTH, WIDTH)))
    accelerator.save_state(tmp_path / "ckpt")
    weights, momenta = _saved(model, optimizer)
    optimizer.optimizer.state.clear()  # no state yet: its file goes to a private copy
    made = _made(monkeypatch)
    accelerator.load_state(tmp_path / "ckpt")
    kept = accelerator.unwrap_model(model).kept
    assert set(kept) == set(weights)
    for key, value in kept.items():  # reusing its buffer would put the momenta here
        assert torch.equal(value, weights[key]), key
    assert len(made) == 2, made  # the optimizer's file got a buffer of its own
    loaded = [s["momentum_buffer"] for s in optimizer.optimizer.state.values()]
    for got, want in zip(loaded, momenta, strict=True):
        assert torch.equal(got, want)


def test_a_reused_buffer_gives_back_the_pages_past_a_shorter_file() -> None:
    with staging.reusing(8 * staging.HUGE):
        first = staging.buffer(8 * staging.HUGE)
        first.fill_(7)  # every page made
        address = first.data_ptr()
        del first
        second = staging.buffer(staging.HUGE)  # reused: the same memory...
    assert second.data_ptr() == address
    whole = torch.empty(0, dtype=torch.uint8).set_(second.untyped_storage())
    assert whole.numel() == 8 * staging.HUGE
    assert bool((whole[: staging.HUGE] == 7).all())  # ...its first bytes as they were left
    # Past the file, the pages were given back (MADV_DONTNEED): zeros again, not resident.
    assert torch.count_nonzero(whole[staging.HUGE :]) == 0


def test_outside_a_load_every_buffer_is_new() -> None:
    first = staging.buffer(staging.HUGE)
    first.fill_(7)
    del first
    second = staging.buffer(staging.HUGE)
    assert torch.count_nonzero(second) == 0  # fresh memory, never another file's bytes

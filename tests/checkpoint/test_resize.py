"""Resuming on another number of processes: exact global sample coverage, equal model and
optimizer state, PowerSGD's per-process state reset (by its CommHook's rule) with one warning,
refusals."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import kwplug
from kwplug import DistributedDataParallelKwargs
from kwplug.checkpoint import _resize as resize
from kwplug.errors import CheckpointError, KwplugWarning
from kwplug.testing import run_distributed
from kwplug.utils import DataLoaderConfiguration

N, BATCH, EPOCHS = 48, 4, 3  # 48 divides 4 and 8: no batch is completed with repeats


def train(
    directory: str,
    resume_from: str | None,
    save_at: tuple[int, int] | None,
    power_sgd: bool,
) -> dict[str, Any]:
    """Train EPOCHS epochs (resuming from ``resume_from``), save into ``directory`` after
    step ``save_at = (epoch, batch)``; return what this rank trained on and the states."""
    torch.manual_seed(0)
    options = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
    ddp = DistributedDataParallelKwargs(
        comm_hook="power_sgd" if power_sgd else "no",
        comm_state_option=options if power_sgd else {},
    )
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[ddp])
    data = TensorDataset(torch.randn(N, 3), torch.randn(N, 1), torch.arange(N))
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=BATCH, shuffle=True)
    )
    caught: list[str] = []
    loaded: dict[str, Any] = {}
    if resume_from is not None:
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            accelerator.load_state(resume_from, exact_data_position=True)
        caught = [str(w.message) for w in records if issubclass(w.category, KwplugWarning)]
        loaded = snapshot(accelerator, optimizer)
    seen: list[tuple[int, list[int]]] = []  # (epoch, indices) per step, in order
    saved: dict[str, Any] = {}
    while loader.epoch < EPOCHS:
        epoch = loader.epoch
        for x, y, index in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            seen.append((epoch, index.tolist()))
            if save_at == (epoch, loader.batches_yielded):
                accelerator.save_state(directory)
                saved = snapshot(accelerator, optimizer)
                saved["steps"] = len(seen)
    return {"seen": seen, "loaded": loaded, "saved": saved, "warnings": caught}


def snapshot(accelerator: kwplug.Accelerator, optimizer: Any) -> dict[str, Any]:
    """The model's parameters and the optimizer's state, on the CPU."""
    model = accelerator.unwrap_model(accelerator._prepared.models[0])
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": {
            i: {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
            for i, s in optimizer.state_dict()["state"].items()
        },
    }


def stream(results: list[dict[str, Any]], start: int = 0) -> list[tuple[int, int]]:
    """The global sample order of every rank's steps from ``start``: step by step, rank by
    rank (the order the ranks' batches were dealt in), as (epoch, sample)."""
    out: list[tuple[int, int]] = []
    steps = [r["seen"][start:] for r in results]
    for step in zip(*steps, strict=True):
        for epoch, indices in step:
            out.extend((epoch, i) for i in indices)
    return out


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for i, state in a["optimizer"].items():
        assert all(torch.equal(v, b["optimizer"][i][k]) for k, v in state.items())


def per_epoch(pairs: list[tuple[int, int]]) -> dict[int, Counter[int]]:
    counts: dict[int, Counter[int]] = {}
    for epoch, sample in pairs:
        counts.setdefault(epoch, Counter())[sample] += 1
    return counts


def test_two_to_one_continues_the_global_stream(tmp_path: Path) -> None:
    # 2 processes with PowerSGD, uninterrupted, saving after 3 steps of epoch 1 (24 of its
    # 48 samples consumed); then 1 process resumes from that checkpoint.
    ckpt = str(tmp_path / "ckpt")
    full = run_distributed(train, ckpt, None, (1, 3), True, nproc=2, timeout=150)
    (resumed,) = run_distributed(train, str(tmp_path / "x"), ckpt, None, True, nproc=1)
    steps = full[0]["saved"]["steps"]
    before, after = stream(full, 0)[: steps * 2 * BATCH], stream([resumed])
    rest = [p for p in stream(full)[len(before) :] if p[0] == 1]
    assert len(rest) == 3 * 2 * BATCH
    # Epoch 1 continues with the same samples in the same order; epoch 2 is shuffled anew
    # (one process draws its order from torch's generator, two from a shared one).
    assert [p for p in after if p[0] == 1] == rest
    assert per_epoch(before + after) == {e: Counter(range(N)) for e in range(EPOCHS)}
    assert_same_state(full[0]["saved"], resumed["loaded"])
    (warning,) = resumed["warnings"]  # one warning, naming the hook and the reason
    assert "saved by 2 process(es), loaded by 1" in warning
    assert "model 0: PowerSGDState (no hook in this run)" in warning  # one process: no DDP


def test_one_to_two_and_back_resumes_at_the_exact_batch(tmp_path: Path) -> None:
    # 1 process saves after 5 batches of epoch 1. 5 batches are not a whole round of 2
    # processes: the 2-process run deals from the 6th batch on (rank 0: 6th, 8th...; rank 1:
    # 7th, 9th...); the 7 batches left are completed to 8 (even_batches, as any short last
    # round). It saves again after one step (7 batches consumed); 1 process resumes from that.
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    (single,) = run_distributed(train, a, None, (1, 5), False, nproc=1)
    pair = run_distributed(train, b, a, (1, 3), False, nproc=2, timeout=150)
    (last,) = run_distributed(train, str(tmp_path / "c"), b, None, False, nproc=1)
    first = stream([single])[: single["saved"]["steps"] * BATCH]
    rest = [p for p in stream([single])[len(first) :] if p[0] == 1]
    assert len(rest) == 7 * BATCH
    resumed = stream(pair)
    # The exact continuation, then the short last round completed as BatchSamplerShard
    # completes one: with the first batch it dealt this epoch (the epoch's 2nd: offset 1).
    second = [p for p in stream([single]) if p[0] == 1][BATCH : 2 * BATCH]
    assert resumed[: len(rest) + BATCH] == rest + second
    counts = per_epoch(first + resumed)
    assert counts[1] == Counter(range(N)) + Counter(i for _, i in second)
    assert counts[0] == counts[2] == Counter(range(N))
    assert_same_state(single["saved"], pair[0]["loaded"])
    assert_same_state(single["saved"], pair[1]["loaded"])
    assert pair[0]["warnings"] == pair[1]["warnings"] == []  # no hook state was saved
    middle = resumed[: 2 * BATCH]  # the step before the second save
    assert [p for p in stream([last]) if p[0] == 1] == rest[2 * BATCH :]
    assert per_epoch(first + middle + stream([last])) == {
        e: Counter(range(N)) for e in range(EPOCHS)
    }
    assert_same_state(pair[0]["saved"], last["loaded"])


class Stream(torch.utils.data.IterableDataset[int]):
    """An iterable data set of N numbers."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(N))


def test_positions_and_refusals() -> None:
    from kwplug.data import prepare_dataloader

    def prepared(world: int, rank: int = 0, split: bool = False) -> Any:
        loader = DataLoader(TensorDataset(torch.arange(N)), batch_size=BATCH)
        config = DataLoaderConfiguration(split_batches=split)
        return prepare_dataloader(loader, torch.device("cpu"), world, rank, config=config)

    position = {"epoch": 1, "batches_yielded": 4, "generator": None, "global_rng": None}
    shape = resize.describe(prepared(2))
    for rank in range(3):  # 2 processes took 8 batches: 2 rounds of 3, and 2 batches more
        three = prepared(3, rank)
        moved = resize.convert_position(position, shape, three, 2, Path("rank_0"))
        assert (moved["batches_yielded"], moved["offset"]) == (2, 2)
        three.load_state_dict(moved)
        assert three.state_dict()["offset"] == 2  # saved again before iterating: unchanged
        start = 4 * (8 + rank)  # rank r: the (9 + r)-th batch
        assert next(iter(three))[0].tolist() == list(range(start, start + 4))
        assert three.state_dict()["offset"] == 2
    # split_batches: every rank took a slice of the same 4 global batches; so do 2 ranks now.
    split = resize.describe(prepared(1, split=True))
    for rank in range(2):
        half = prepared(2, rank, split=True)
        half.load_state_dict(resize.convert_position(position, split, half, 1, Path("rank_0")))
        start = 4 * BATCH + 2 * rank
        assert next(iter(half))[0].tolist() == [start, start + 1]
    with pytest.raises(CheckpointError, match="split_batches was True when saved and is False"):
        resize.convert_position(position, split, prepared(2), 1, Path("rank_0"))
    big = prepare_dataloader(
        DataLoader(TensorDataset(torch.arange(N)), batch_size=8), torch.device("cpu"), 1, 0
    )
    with pytest.raises(CheckpointError, match="batch_size was 4 when saved and is 8"):
        resize.convert_position(position, shape, big, 2, Path("rank_0"))
    stream = prepare_dataloader(DataLoader(Stream(), batch_size=BATCH), torch.device("cpu"), 3, 0)
    iterable = resize.describe(
        prepare_dataloader(DataLoader(Stream(), batch_size=BATCH), torch.device("cpu"), 2, 0)
    )
    with pytest.raises(CheckpointError, match="iterable data set's position"):
        resize.convert_position(position, iterable, stream, 2, Path("rank_0"))
    with pytest.raises(CheckpointError, match="no data loader sharding"):
        resize.convert_position(position, None, three, 2, Path("rank_0"))


def test_rng_is_rederived_per_rank() -> None:
    from kwplug.checkpoint import _rng as rng

    torch.manual_seed(3)
    saved = rng.rng_state(torch.device("cpu"))
    draws = []
    for rank in (0, 1, 2, 1):
        resize.set_resized_rng(saved, rank, torch.device("cpu"))
        draws.append(torch.rand(2))
    torch.manual_seed(3)
    assert torch.equal(draws[0], torch.rand(2))  # rank 0: the saved rank 0's stream
    assert not torch.equal(draws[1], draws[2])
    assert torch.equal(draws[1], draws[3])  # deterministic


class Residuals:
    """A hook state with ``state_dict``: reset across sizes, whatever it holds."""

    def __init__(self) -> None:
        self.value = torch.zeros(2)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


@pytest.mark.usefixtures("one_process_group")
def test_hook_state_keeps_counters_and_resets_per_process_state() -> None:
    # PowerSGD's rule comes with its CommHook record (the core knows no hook): counters kept.
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    from kwplug.attached_state import hook_state_dict
    from kwplug.plugins import ddp_comm_hooks

    record = ddp_comm_hooks.builtin_comm_hooks()["power_sgd"]

    def power_sgd() -> Any:
        state = PowerSGDState(process_group=None, start_powerSGD_iter=2)
        return ddp_comm_hooks.checkpointed_state(record, state)

    saved, residuals = power_sgd(), Residuals()
    saved.state.iter, saved.state.error_dict = 7, {0: torch.ones(3)}
    saved.state.p_memory_dict, saved.state.q_memory_dict = {0: torch.ones(2)}, {0: torch.ones(2)}
    residuals.value = torch.ones(2)
    snapshots = [[hook_state_dict(saved), hook_state_dict(residuals)]]
    live, fresh = power_sgd(), Residuals()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        resize.load_resized_hooks([[live, fresh]], snapshots, (2, 3))
    (warning,) = [str(w.message) for w in records if issubclass(w.category, KwplugWarning)]
    assert "model 0: PowerSGDState (per-process state reset, counters kept)" in warning
    assert "model 0: Residuals (reset)" in warning
    assert live.state.iter == 7  # compression goes on without a new warm-up
    assert live.state.error_dict == live.state.p_memory_dict == live.state.q_memory_dict == {}
    assert torch.equal(fresh.value, torch.zeros(2))


def save_mid_accumulation(directory: str, load: bool) -> str:
    """Save after the first of two micro-batches, or (``load``) try to load that."""
    accelerator = kwplug.Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if load:
        try:
            accelerator.load_state(directory, exact_data_position=True)
        except CheckpointError as exc:
            return str(exc)
        return "loaded"
    with accelerator.accumulate(model):
        accelerator.backward(model(torch.ones(2, 3)).sum())
        optimizer.step()
        optimizer.zero_grad()
    assert not accelerator.sync_gradients
    accelerator.save_state(directory)
    return "saved"


def test_mid_accumulation_checkpoint_is_refused_at_another_size(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    assert run_distributed(save_mid_accumulation, directory, False) == ["saved", "saved"]
    (error,) = run_distributed(save_mid_accumulation, directory, True, nproc=1)
    assert "accumulation_0.safetensors was saved in the middle of a gradient" in error
    assert "the local gradients cannot be redistributed" in error

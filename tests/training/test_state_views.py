"""Accelerate's module-level state names on kwplug: ``kwplug.state.GradientState``,
``kwplug.data_loader.prepare_data_loader``, ``kwplug.utils.synchronize_rng_states`` (their
2-process behaviour is checked by Accelerate's own test scripts in tests/compat)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import kwplug
from kwplug.data_loader import DataLoaderDispatcher, prepare_data_loader, skip_first_batches
from kwplug.state import AcceleratorState, GradientState
from kwplug.utils import GradientAccumulationPlugin, synchronize_rng_states


def test_gradient_state_reads_the_live_accelerators() -> None:
    AcceleratorState._reset_state()
    fresh = GradientState()
    assert (fresh.sync_gradients, fresh.num_steps, fresh.active_dataloader) == (True, 1, None)
    assert not fresh.initialized and fresh.remainder == -1
    accelerator = kwplug.Accelerator(
        cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2)
    )
    model = accelerator.prepare(torch.nn.Linear(1, 1))
    loader = accelerator.prepare(DataLoader(torch.ones(6, 1), batch_size=2))
    seen = []
    for _ in loader:
        with accelerator.accumulate(model):
            state = GradientState()
            assert state.active_dataloader is loader and state.in_dataloader
            seen.append((state.sync_gradients, state.end_of_dataloader))
    # Steps 1, 2, 3 of 2-step accumulation: the loader's end forces the last sync.
    assert seen == [(False, False), (True, False), (True, True)]
    assert GradientState().num_steps == 2 and GradientState().plugin_kwargs == {"num_steps": 2}
    GradientState._reset_state()  # nothing to reset: the Accelerator keeps its state
    assert GradientState().num_steps == 2
    AcceleratorState._reset_state()  # forgets the live Accelerator for new views
    assert GradientState().num_steps == 1
    with pytest.raises(TypeError, match="pass the plugin to Accelerator"):
        GradientState(GradientAccumulationPlugin(num_steps=2))


def test_prepare_data_loader_shards_as_accelerate_and_refuses_what_it_cannot_do() -> None:
    data = DataLoader(list(range(10)), batch_size=2)
    rank1 = prepare_data_loader(data, torch.device("cpu"), num_processes=2, process_index=1)
    assert [b.tolist() for b in rank1] == [[2, 3], [6, 7], [0, 1]]
    dispatched = prepare_data_loader(data, dispatch_batches=True)  # one process: its own
    assert isinstance(dispatched, DataLoaderDispatcher)
    assert skip_first_batches(rank1, 1) is rank1
    assert [b.tolist() for b in rank1] == [[6, 7], [0, 1]]
    with pytest.raises(ValueError, match="synchronize_rng_states"):
        prepare_data_loader(data, rng_types=["torch", "generator"])
    with pytest.raises(ValueError, match="slice_fn_for_dispatch"):
        prepare_data_loader(data, slice_fn_for_dispatch=lambda *a: a)
    with pytest.raises(ValueError, match=r"process_index must be in \[0, 2\), got 2"):
        prepare_data_loader(data, torch.device("cpu"), 2, 2)
    with pytest.raises(TypeError, match="split_batches"):
        prepare_data_loader(data, split_batches=1)  # type: ignore[arg-type]
    # A plain DataLoader (Accelerate accepts one): a one-process prepared copy that skips.
    skipped = skip_first_batches(data, 1)
    assert skipped is not data
    assert [b.tolist() for b in skipped] == [[2, 3], [4, 5], [6, 7], [8, 9]]
    assert len([b.tolist() for b in data]) == 5  # the original still yields all 5
    with pytest.raises(TypeError, match="DataLoader"):
        skip_first_batches([1, 2], 1)


def test_synchronize_rng_states_validates_before_any_collective() -> None:
    before = torch.get_rng_state()
    synchronize_rng_states(["torch", "generator"], generator=torch.Generator())  # 1 process
    assert torch.equal(torch.get_rng_state(), before)
    with pytest.raises(ValueError, match="rng_type must be one of 'torch'"):
        synchronize_rng_states(["tpu"])
    with pytest.raises(ValueError, match="needs generator="):
        synchronize_rng_states(["generator"])
    with pytest.raises(ValueError, match="no XLA support"):
        synchronize_rng_states(["xla"])

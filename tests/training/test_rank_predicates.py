"""``Accelerator`` and ``accelerator.state`` answer Accelerate's rank predicates from one
implementation, and agree on every rank layout."""

from __future__ import annotations

import inspect

import pytest
import torch

import kwplug
from kwplug.accelerator._process import ProcessState
from kwplug.utils import DistributedType

PREDICATES = ("is_main_process", "is_local_main_process", "is_last_process", "use_distributed")


@pytest.mark.parametrize("name", PREDICATES)
def test_one_implementation_serves_facade_and_state(name: str) -> None:
    on_facade = inspect.getattr_static(kwplug.Accelerator, name)
    assert isinstance(on_facade, property)
    assert on_facade is inspect.getattr_static(ProcessState, name)


@pytest.mark.parametrize(
    ("world", "rank", "local", "expected"),
    [
        (1, 0, 0, (True, True, True, False)),
        (4, 0, 0, (True, True, False, True)),
        (4, 2, 0, (False, True, False, True)),
        (4, 3, 1, (False, False, True, True)),
    ],
)
def test_facade_and_state_agree(
    world: int, rank: int, local: int, expected: tuple[bool, ...]
) -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    # The ranks are plain attributes; set them as another process would have them.
    accelerator.num_processes, accelerator.process_index = world, rank
    accelerator.local_process_index = local
    state = ProcessState(world, rank, local, torch.device("cpu"), DistributedType.NO, "no")
    assert tuple(getattr(accelerator, name) for name in PREDICATES) == expected
    assert tuple(getattr(state, name) for name in PREDICATES) == expected
    assert tuple(getattr(accelerator.state, name) for name in PREDICATES) == expected
    assert accelerator.distributed is expected[3]


def test_state_stays_a_slotted_frozen_snapshot() -> None:
    state = kwplug.Accelerator(cpu=True).state
    assert not hasattr(state, "__dict__")
    with pytest.raises(AttributeError):
        state.process_index = 1  # type: ignore[misc]

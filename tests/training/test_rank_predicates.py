"""``Accelerator`` and ``accelerator.state`` answer Accelerate's rank predicates from one
implementation, and agree on every rank layout."""

from __future__ import annotations

import inspect

import pytest
import torch

import kwplug
from kwplug.state import AcceleratorState, PartialState
from kwplug.utils import DistributedType

PREDICATES = ("is_main_process", "is_local_main_process", "is_last_process", "use_distributed")


@pytest.mark.parametrize("name", PREDICATES)
def test_one_implementation_serves_facade_and_state(name: str) -> None:
    on_facade = inspect.getattr_static(kwplug.Accelerator, name)
    assert isinstance(on_facade, property)
    assert on_facade is inspect.getattr_static(PartialState, name)
    assert on_facade is inspect.getattr_static(AcceleratorState, name)


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
    assert tuple(getattr(accelerator, name) for name in PREDICATES) == expected
    assert tuple(getattr(accelerator.state, name) for name in PREDICATES) == expected
    assert accelerator.distributed is expected[3]


def test_state_is_the_accelerators_accelerator_state() -> None:
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="bf16")
    state = accelerator.state
    assert isinstance(state, AcceleratorState)
    assert (state.device, state.mixed_precision) == (torch.device("cpu"), "bf16")
    assert state.distributed_type is DistributedType.NO
    # Accelerate's state methods, as scripts call them on accelerator.state.
    state.wait_for_everyone()
    assert callable(state.destroy_process_group) and callable(state.print)
    # Assigning distributed_type changes what the Accelerator reports (Accelerate's shared
    # state does the same); a new state view sees it too.
    state.distributed_type = DistributedType.FSDP
    assert accelerator.distributed_type is DistributedType.FSDP
    assert accelerator.state.distributed_type is DistributedType.FSDP
    with pytest.raises(ValueError):
        state.distributed_type = "NOT_A_TYPE"

"""Distributed metrics and process control against Accelerate in 1 and 2 processes."""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import attrs
import pytest
import torch
from torch.utils.data import DataLoader

import kwplug
from kwplug.testing import run_distributed
from kwplug.utils import DistributedType, set_seed

pytest.importorskip("accelerate")


def _metrics(accelerator: Any, length: int, batch_size: int) -> dict[str, Any]:
    """Gather every evaluation batch for metrics, as tensors, nested and as objects."""
    loader = accelerator.prepare(DataLoader(list(range(length)), batch_size=batch_size))
    tensors, nested, objects = [], [], []
    for batch in loader:
        tensors.append(accelerator.gather_for_metrics(batch))
        nested.append(accelerator.gather_for_metrics({"ids": (batch, batch * 2)}))
        objects.extend(accelerator.gather_for_metrics(batch.tolist(), use_gather_object=True))
    return {
        "tensors": torch.cat(tensors).tolist(),
        "nested": torch.cat([n["ids"][1] for n in nested]).tolist(),
        "objects": objects,
    }


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, torch.Tensor) else value


def _splits(accelerator: Any) -> dict[str, Any]:
    out = {}
    inputs: dict[str, Any] = {
        "list": list(range(7)),
        "tuple": tuple("abcde"),
        "tensor": torch.arange(5),
        "dict": {"a": list(range(3)), "b": torch.arange(3)},
        "few": [1],
    }
    for name, value in inputs.items():
        for padding in (False, True):
            try:
                # A fresh copy each time: Accelerate splits a dict in place.
                fresh = copy.deepcopy(value)
                with accelerator.split_between_processes(fresh, apply_padding=padding) as part:
                    if isinstance(part, dict):
                        part = {k: _plain(v) for k, v in part.items()}
                    out[f"{name}-{padding}"] = _plain(part)
            except Exception as error:  # Accelerate cannot pad a tuple
                out[f"{name}-{padding}"] = f"raised {type(error).__name__}"
    return out


def _decorated(accelerator: Any) -> list[str]:
    ran: list[str] = []
    accelerator.on_main_process(lambda: ran.append("main"))()
    accelerator.on_local_main_process(lambda: ran.append("local"))()
    accelerator.on_last_process(lambda: ran.append("last"))()
    accelerator.on_process(process_index=1)(lambda: ran.append("one"))()
    return ran


def both_libraries() -> dict[str, Any]:
    """In each rank: the same calls through kwplug's and Accelerate's Accelerator."""
    from accelerate import Accelerator as AccelerateAccelerator

    ours = kwplug.Accelerator(cpu=True)
    theirs = AccelerateAccelerator(cpu=True)
    result: dict[str, Any] = {"rank": ours.process_index}
    for name, accelerator in (("kwplug", ours), ("accelerate", theirs)):
        set_seed(0)
        row = {
            f"metrics-{n}-{b}": _metrics(accelerator, n, b) for n, b in ((23, 4), (9, 5), (8, 4))
        }
        row["splits"] = _splits(accelerator)
        if accelerator.process_index == accelerator.num_processes - 1:
            accelerator.set_trigger()
        row["triggers"] = [accelerator.check_trigger(), accelerator.check_trigger()]
        row["flags"] = [
            accelerator.is_last_process,
            accelerator.use_distributed,
            str(accelerator.distributed_type.value),
        ]
        row["ran"] = _decorated(accelerator)
        with accelerator.main_process_first():
            row["first"] = True
        with accelerator.local_main_process_first():
            row["local_first"] = True
        row["gather"] = accelerator.gather({"x": (torch.tensor([accelerator.process_index]),)})
        row["reduce"] = accelerator.reduce({"x": torch.tensor([1.0, 2.0])}, reduction="sum")
        result[name] = row
    ours.end_training()
    return result


def _check(results: list[dict[str, Any]]) -> None:
    for row in results:
        ours, theirs = row["kwplug"], row["accelerate"]
        assert ours.keys() == theirs.keys()
        for key in ours:
            if key in ("gather", "reduce"):
                assert repr(ours[key]) == repr(theirs[key]), key
            elif key == "splits":
                for case, part in theirs[key].items():
                    if not str(part).startswith("raised"):
                        assert ours[key][case] == part, case
                assert not str(ours[key]["tuple-True"]).startswith("raised")
            else:
                assert ours[key] == theirs[key], key
        for key in ours:
            if key.startswith("metrics-"):
                length = int(key.split("-")[1])
                assert sorted(ours[key]["tensors"]) == list(range(length))
                assert sorted(ours[key]["objects"]) == list(range(length))


def test_metrics_and_process_control_match_accelerate_in_one_process() -> None:
    _check([both_libraries()])


@pytest.mark.multiprocess
def test_metrics_and_process_control_match_accelerate_in_two_processes() -> None:
    results = run_distributed(both_libraries, nproc=2, timeout=240)
    _check(results)
    assert [r["kwplug"]["ran"] for r in results] == [["main", "local"], ["last", "one"]]
    assert results[0]["kwplug"]["flags"] == [False, True, "MULTI_CPU"]


def test_state_and_distributed_type_in_one_process() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    state = accelerator.state
    assert state.distributed_type is DistributedType.NO is accelerator.distributed_type
    assert (state.num_processes, state.process_index, state.mixed_precision) == (1, 0, "no")
    assert state.is_main_process and state.is_last_process and not state.use_distributed


def test_distributed_type_declared_by_a_handler() -> None:
    @attrs.define
    class Sharding(kwplug.KwargsHandler):
        distributed_type: ClassVar[str] = "FSDP"

    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[Sharding()])
    assert accelerator.distributed_type is DistributedType.FSDP


def test_free_memory_drops_prepared_objects() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    assert accelerator._prepared.models == [model]
    assert accelerator.free_memory(model, 1) == [None, None]
    assert accelerator._prepared.models == [] and accelerator.clear() == []


def test_on_process_needs_an_index_and_split_checks_lengths() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    with pytest.raises(ValueError, match="process_index"):
        accelerator.on_process(lambda: None)
    assert accelerator.on_process(process_index=3)(lambda: 5)() == 5  # one process: runs
    assert accelerator.check_trigger() is False
    accelerator.set_trigger()
    assert accelerator.check_trigger() is True and accelerator.check_trigger() is False


def test_pickling_an_accelerator_is_a_clear_error_and_its_prepared_objects_pickle() -> None:
    import pickle

    accelerator = kwplug.Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    _, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    for prepared in (optimizer, scheduler, loader):
        assert type(pickle.loads(pickle.dumps(prepared))) is type(prepared)
    for attempt in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match="an Accelerator cannot be pickled .* save_state"):
            attempt(accelerator)

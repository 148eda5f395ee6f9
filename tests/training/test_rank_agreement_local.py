"""What ranks compare at construction (:mod:`kwplug.accelerator._agreement`), in one process:
no collective without a second rank, canonical values, the error's message and attributes;
and ``end_training()`` without a process group collects no garbage (issue 20 goal 4)."""

from __future__ import annotations

import functools
import gc
import pickle
from datetime import timedelta
from typing import Any
from unittest import mock

import attrs
import torch
import torch.distributed as dist
from python import python

import kwplug
from kwplug.accelerator import _agreement
from kwplug.accelerator._options import resolve_options
from kwplug.errors import KwplugError, RankMismatchError
from kwplug.handler import AGREE


def options(**changes: Any) -> Any:
    args: dict[str, Any] = {
        "gradient_accumulation_steps": 1,
        "gradient_accumulation_plugin": None,
        "dataloader_config": None,
        "project_dir": None,
        "project_config": None,
        "log_with": None,
        "step_scheduler_with_optimizer": True,
        "split_batches": None,
        "even_batches": None,
    }
    return resolve_options(**{**args, **changes})


def test_one_process_makes_no_collective(one_process_group: None) -> None:
    # Issue 20: repeated Accelerator() stays cheap; in one process nothing is exchanged, with
    # or without a (one-rank) process group.
    with mock.patch.object(dist, "all_gather_object") as gather:
        kwplug.Accelerator(cpu=True)
    gather.assert_not_called()


@attrs.define
class _Sharded(kwplug.KwargsHandler):
    chunks: int = 4
    scratch_dir: str = attrs.field(default="/tmp/rank-local", metadata={AGREE: False})


def test_a_handlers_own_fields_take_part_unless_marked() -> None:
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[_Sharded(chunks=8)])
    described = _agreement.describe(accelerator._setup, options())
    assert described["_Sharded.chunks"] == 8
    assert "_Sharded.scratch_dir" not in described
    assert f"{__name__}._Sharded" in described["handlers"]
    # The default-built handlers too, by class: given with default values or not, the same.
    given = kwplug.Accelerator(cpu=True, kwargs_handlers=[kwplug.DistributedDataParallelKwargs()])
    plain = kwplug.Accelerator(cpu=True)
    assert _agreement.describe(given._setup, options()) == _agreement.describe(
        plain._setup, options()
    )
    assert _agreement.describe(plain._setup, options())["DistributedDataParallelKwargs.dim"] == 0


def test_the_description_is_the_same_in_another_process() -> None:
    # Hash randomisation, memory addresses and set order must not make equal settings differ.

    script = (
        "import kwplug; from kwplug.accelerator import _agreement as a;"
        "from kwplug.accelerator._options import resolve_options as r;"
        "acc = kwplug.Accelerator(cpu=True, mixed_precision='bf16');"
        "print(a.digest(a.describe(acc._setup, r(2, None, None, None, None, None, True,"
        " None, None))))"
    )
    digests = {python("-c", script, check=True).stdout.strip() for _ in range(2)}
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="bf16")
    here = _agreement.digest(
        _agreement.describe(accelerator._setup, options(gradient_accumulation_steps=2))
    )
    assert digests == {here}


def test_canonical_values() -> None:
    canonical = _agreement.canonical
    assert canonical({"b", "a", "c"}) == ["a", "b", "c"]
    assert canonical({2: "x", "k": (1, 2.5)}) == {"2": "x", "k": [1, 2.5]}
    assert canonical(timedelta(minutes=1)) == 60.0
    assert canonical(float("nan")) == "nan"
    assert canonical(torch.float16) == "torch.float16"
    assert canonical(kwplug.DistributedDataParallelKwargs().comm_hook) == "no"
    assert canonical(functools.reduce) == "_functools.reduce"
    assert canonical(functools.partial(max, 1, key=abs)) == {
        "partial": "builtins.max",
        "args": [1],
        "keywords": {"key": "builtins.abs"},
    }
    assert canonical(object()) == "<object object>"  # no address: equal on every rank
    deep: list[Any] = []
    for _ in range(100):
        deep = [deep]
    assert "list" in str(canonical(deep))  # no RecursionError


def test_the_error_names_each_field_and_rank_and_pickles() -> None:
    same = {"torch version": "2.13.0", "x": 1}
    descriptions = [
        {**same, "mixed_precision": "bf16", "big": "v" * 1000},
        {**same, "mixed_precision": "no", "big": "w"},
        {**same, "mixed_precision": "no", "big": "w"},
        {**same, "mixed_precision": "bf16", "big": "w", "plugin 'extra'": "extra 1.0"},
    ]
    error = _agreement.mismatch_error(descriptions)
    assert isinstance(error, RankMismatchError)
    assert isinstance(error, KwplugError) and isinstance(error, RuntimeError)
    assert error.field == "mixed_precision"
    assert error.values == ('"bf16"', '"no"', '"no"', '"bf16"')
    assert set(error.mismatches) == {"mixed_precision", "big", "plugin 'extra'"}
    message = str(error)
    assert 'mixed_precision: "bf16" on ranks 0, 3, "no" on ranks 1-2' in message
    assert "plugin 'extra': <absent> on ranks 0-2, \"extra 1.0\" on rank 3" in message
    assert "(1002 characters)" in message and "v" * 1000 not in message  # quoted in part
    assert len(error.mismatches["big"][0]) == 1002  # the attribute keeps it whole
    again = pickle.loads(pickle.dumps(error))
    assert (again.field, again.values, again.mismatches) == (
        error.field,
        error.values,
        error.mismatches,
    )


def test_end_training_without_a_group_collects_no_garbage() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))
    with mock.patch.object(gc, "collect") as collect:
        accelerator.end_training()
    collect.assert_not_called()


def test_end_training_with_a_group_collects_before_destroying_it() -> None:
    # The reason collection was added: a DDP reducer collected after its group is destroyed
    # can abort the process.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    calls: list[str] = []
    destroy = dist.destroy_process_group

    def destroying(*args: Any) -> None:
        calls.append("destroy")
        destroy(*args)

    try:
        accelerator = kwplug.Accelerator(cpu=True)
        with (
            mock.patch.object(gc, "collect", side_effect=lambda: calls.append("collect")),
            mock.patch.object(dist, "destroy_process_group", destroying),
        ):
            accelerator.end_training()
    finally:
        if dist.is_initialized():
            destroy()
    assert calls == ["collect", "destroy"]

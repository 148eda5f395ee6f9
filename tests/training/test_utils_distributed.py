"""kwplug.utils collectives against accelerate.utils in 2 processes (torchrun, gloo).

One torchrun job computes everything: kwplug's Accelerator starts the process group,
Accelerate's Accelerator joins it, and each rank returns both libraries' results.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kwplug.testing import run_distributed

pytest.importorskip("accelerate")


def _catch(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as error:
        return f"{type(error).__name__}: {error}"


def both_libraries() -> dict[str, Any]:
    """Run in each rank: the same calls through kwplug.utils and accelerate.utils."""
    import numpy as np
    from accelerate import Accelerator as AccelerateAccelerator
    from accelerate import utils as acc

    import kwplug.utils as ku
    from kwplug import Accelerator

    accelerator = Accelerator(cpu=True)
    state = AccelerateAccelerator(cpu=True)  # set_seed(device_specific=True) needs its state
    rank = accelerator.process_index
    assert state.num_processes == 2 and state.process_index == rank
    ragged = {"ids": torch.arange(3 + 2 * rank).reshape(-1, 1) + 10 * rank, "n": torch.tensor(rank)}
    same = {"x": torch.full((2, 3), float(rank + 1)), "y": [torch.tensor([rank, 5 - rank])]}
    out: dict[str, Any] = {"rank": rank}
    for name, lib in (("kwplug", ku), ("accelerate", acc)):
        pad_end = lib.pad_across_processes(ragged, dim=0, pad_index=-1)
        pad_first = lib.pad_across_processes(ragged["ids"], dim=0, pad_index=7, pad_first=True)
        out[name] = {
            "pad_end": pad_end,
            "pad_first": pad_first,
            "pad_dim1": lib.pad_across_processes(torch.ones(2, 1 + rank), dim=-1),
            "pad_out_of_range": lib.pad_across_processes(torch.ones(2), dim=3),
            "gather_padded": lib.gather(pad_end),
            "gather": lib.gather(same),
            "gather_scalar": lib.gather(torch.tensor(float(rank))),
            "reduce_mean": lib.reduce(same["x"], reduction="mean"),
            "reduce_sum": lib.reduce(same, reduction="sum"),
            "reduce_max": lib.reduce(same["y"][0], reduction="max"),
            "gather_object": lib.gather_object([{"rank": rank}, f"r{rank}"]),
            "broadcast": lib.broadcast(torch.full((3,), float(rank)), from_process=1),
            "broadcast_object_list": lib.broadcast_object_list([rank, f"from {rank}"]),
        }
        lib.set_seed(5, device_specific=True)
        out[name]["seeded"] = (random.random(), np.random.rand(), torch.rand(2))
    # kwplug only: mismatches are errors on every rank, and the group stays usable after them.
    out["errors"] = {
        "gather": _catch(ku.gather, ragged["ids"]),
        "gather_dtype": _catch(
            ku.gather, torch.zeros(2, dtype=torch.float32 if rank else torch.int64)
        ),
        "gather_structure": _catch(ku.gather, [torch.zeros(1)] * (rank + 1)),
        "reduce": _catch(ku.reduce, torch.zeros(rank + 1)),
        "broadcast": _catch(ku.broadcast, {"a": torch.zeros(2, rank + 1)}),
        "pad_ndim": _catch(ku.pad_across_processes, torch.zeros([1] * (rank + 1))),
        "copy_nobody": _catch(ku.copy_tensor_to_devices, None),
        "copy_everybody": _catch(ku.copy_tensor_to_devices, torch.zeros(1)),
    }
    # kwplug only: Accelerate's copy_tensor_to_devices fails on the CPU where a process passes
    # None (torch.zeros of a shape tensor). Only rank 1 holds it: the others learn its shape
    # and dtype from the call.
    out["copy_tensor_to_devices"] = ku.copy_tensor_to_devices(
        torch.tensor([[1, 2, 3]], dtype=torch.int32) if rank == 1 else None
    )
    out["after_errors"] = ku.gather(torch.tensor([rank]))
    out["gather_object_dict"] = ku.gather_object({"rank": rank})
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(both_libraries, nproc=2, timeout=300)


def _same(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs)
    if isinstance(ours, torch.Tensor):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert torch.equal(ours, theirs), (ours, theirs)
    elif isinstance(ours, dict):
        assert ours.keys() == theirs.keys()
        for key in ours:
            _same(ours[key], theirs[key])
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs)
        for x, y in zip(ours, theirs, strict=True):
            _same(x, y)
    else:
        assert ours == theirs


def test_two_process_results_equal_accelerates(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert result["kwplug"].keys() == result["accelerate"].keys()
        for key in result["kwplug"]:
            _same(result["kwplug"][key], result["accelerate"][key])


def test_two_process_values(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = (r["kwplug"] for r in ranks)
    # Rank 0 has 3 ids, rank 1 has 5: rank 0 is padded with -1 at the end (or 7 first).
    assert rank0["pad_end"]["ids"].flatten().tolist() == [0, 1, 2, -1, -1]
    assert rank0["pad_first"].flatten().tolist() == [7, 7, 0, 1, 2]
    assert torch.equal(rank1["pad_end"]["ids"].flatten(), torch.arange(5) + 10)
    assert rank0["pad_dim1"].tolist() == [[1.0, 0.0], [1.0, 0.0]]
    assert rank0["gather_padded"]["ids"].flatten().tolist() == [0, 1, 2, -1, -1, *range(10, 15)]
    assert rank0["gather_padded"]["n"].tolist() == [0, 1]  # 0-d tensors become (2,)
    assert rank0["gather_scalar"].tolist() == [0.0, 1.0]
    assert rank0["gather"]["x"].shape == (4, 3)
    assert rank0["reduce_mean"].unique().tolist() == [1.5]
    assert rank0["reduce_sum"]["y"][0].tolist() == [1, 9]
    assert rank0["reduce_max"].tolist() == [1, 5]
    assert rank0["gather_object"] == [{"rank": 0}, "r0", {"rank": 1}, "r1"]
    assert rank0["broadcast"].tolist() == [1.0] * 3 == rank1["broadcast"].tolist()
    assert rank0["broadcast_object_list"] == [0, "from 0"] == rank1["broadcast_object_list"]
    for copied in (ranks[0]["copy_tensor_to_devices"], ranks[1]["copy_tensor_to_devices"]):
        assert copied.dtype == torch.int32 and copied.tolist() == [[1, 2, 3]]
    # device_specific seeds differ per rank (5 + rank).
    assert rank0["seeded"][0] != rank1["seeded"][0]


def test_shape_mismatches_raise_on_every_rank_naming_the_shapes(
    ranks: list[dict[str, Any]],
) -> None:
    for result in ranks:
        errors = result["errors"]
        assert errors["gather"].startswith("DistributedOperationException: gather needs")
        assert "rank 0: shape [3, 1] int64" in errors["gather"]
        assert "rank 1: shape [5, 1] int64" in errors["gather"]
        assert "pad_across_processes" in errors["gather"]
        assert "rank 0: shape [2] int64" in errors["gather_dtype"]
        assert "rank 1: shape [2] float32" in errors["gather_dtype"]
        assert "rank 1: [0] shape [1], [1] shape [1]" in errors["gather_structure"].replace(
            " float32", ""
        )
        assert "reduce needs" in errors["reduce"] and "shape [2]" in errors["reduce"]
        assert "rank 1: ['a'] shape [2, 2] float32" in errors["broadcast"]
        assert errors["pad_ndim"].startswith("DistributedOperationException: pad_across")
        assert "rank 1: [[1, 1]]" in errors["pad_ndim"]
        assert errors["copy_nobody"] == (
            "ValueError: copy_tensor_to_devices needs the tensor on exactly one process and "
            "None on the others; ranks holding one: []"
        )
        assert errors["copy_everybody"].endswith("ranks holding one: [0, 1]")
        assert result["after_errors"].tolist() == [0, 1]
        # A non-list object is one element (Accelerate would iterate the dict's keys).
        assert result["gather_object_dict"] == [{"rank": 0}, {"rank": 1}]

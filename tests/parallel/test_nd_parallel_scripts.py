"""Accelerate's FSDP2/ND-parallel example scripts (adapted to CPU in
``tests/parallel/accelerate_scripts.py``, their Accelerator and plugin calls as written) run on
kwplug in 2 and 4 gloo processes; their fp32 losses equal the same script's DDP run within
reduction-order tolerance."""

from __future__ import annotations

from typing import Any

import pytest
from accelerate_scripts import fsdp_peak_mem, nd_parallel

from kwplug.testing import run_distributed

STEPS = 6
TOL = 1e-5


def _largest(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _nd(nproc: int, sizes: tuple[int, int, int]) -> list[Any]:
    return run_distributed(nd_parallel, *sizes, STEPS, nproc=nproc, timeout=400)


@pytest.mark.timeout(900)  # several torchrun jobs of 2-4 processes on 2 cores
def test_nd_parallel_in_two_processes() -> None:
    ddp = _nd(2, (2, 1, 1))  # dp_replicate only: DDP
    fsdp = _nd(2, (1, 2, 1))
    tp = _nd(2, (1, 1, 2))
    assert ddp[0]["mesh"] == ["dp_replicate"] and ddp[0]["distributed_type"] == "MULTI_CPU"
    assert fsdp[0]["mesh"] == ["dp_shard"] and fsdp[0]["distributed_type"] == "FSDP"
    assert _largest(fsdp[0]["losses"], ddp[0]["losses"]) < TOL
    # Pure TP: one data-parallel rank, so the 1-process batches; both ranks see the same loss.
    assert tp[0]["mesh"] == ["tp"] and tp[0]["losses"] == tp[1]["losses"]
    assert len(tp[0]["losses"]) == STEPS


@pytest.mark.timeout(900)  # several torchrun jobs of 2-4 processes on 2 cores
def test_nd_parallel_in_four_processes() -> None:
    ddp4 = _nd(4, (4, 1, 1))
    hsdp = _nd(4, (2, 2, 1))
    ddp2 = _nd(2, (2, 1, 1))
    fsdp_tp = _nd(4, (1, 2, 2))
    assert hsdp[0]["mesh"] == ["dp_replicate", "dp_shard"]
    assert _largest(hsdp[0]["losses"], ddp4[0]["losses"]) < TOL
    # dp_shard=2 x tp=2: two data-parallel ranks, the batches of a 2-process run.
    assert fsdp_tp[0]["mesh"] == ["dp_shard", "tp"]
    assert _largest(fsdp_tp[0]["losses"], ddp2[0]["losses"]) < TOL


@pytest.mark.timeout(900)  # several torchrun jobs of 2-4 processes on 2 cores
@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp_with_peak_mem_tracking(nproc: int) -> None:
    ddp = run_distributed(fsdp_peak_mem, False, nproc=nproc, timeout=400)
    fsdp = run_distributed(fsdp_peak_mem, True, nproc=nproc, timeout=400)
    assert fsdp[0]["fsdp"] and not ddp[0]["fsdp"]
    assert fsdp[0]["seen"] == 32  # gather_for_metrics: every validation sample, once
    assert _largest(fsdp[0]["losses"], ddp[0]["losses"]) < TOL
    assert fsdp[0]["accuracies"] == ddp[0]["accuracies"]

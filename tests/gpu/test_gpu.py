"""The GPU suite: nccl, CUDA autocast + GradScaler, DDP device_ids, every comm hook on nccl,
the cuda profiler activity, FSDP2 and the wire-bound benchmark on nccl.

Every test is skipped without CUDA (conftest.py marks them at collection; nothing here touches
the device at import). Run it with ``scripts/gpu-check``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gpu_workers
import pytest
import torch

import kwplug
from kwplug.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count()
#: NCCL allows one rank per GPU in a communicator ("Duplicate GPU detected"): with one GPU the
#: two ranks of the DDP tests share it through gloo (which handles CUDA tensors), and the
#: nccl-only tests run a single rank.
NPROC = 2
BACKEND = "nccl" if GPUS >= 2 else "gloo"
NCCL_RANKS = min(2, GPUS)
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs (NCCL: one rank per GPU)")
compress = importlib.util.find_spec("kwplug_compress") is not None
HOOKS: dict[str, dict[str, Any]] = {
    "no": {},
    "fp16": {},
    "bf16": {},
    "power_sgd": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2},
    "batched_power_sgd": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2},
    "power_sgd_inplace": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2},
    **({"int8": {}, "topk": {"ratio": 0.05}} if compress else {}),
}


def test_nccl_process_group_uses_the_handlers_timeout() -> None:
    results = run_distributed(gpu_workers.nccl_process_group, nproc=NCCL_RANKS, timeout=180)
    for rank, result in enumerate(results):
        assert result["backend"] == "nccl"
        assert result["device"] == f"cuda:{result['local_rank']}"
        assert result["current_device"] == result["local_rank"]
        assert result["sum"] == sum(range(1, NCCL_RANKS + 1))
        if result["timeout_s"] is not None:  # ProcessGroupNCCL.Options._timeout, when exposed
            assert result["timeout_s"] == gpu_workers.TIMEOUT_S, rank


def test_fp16_autocast_with_grad_scaler() -> None:
    scaler_handler = kwplug.GradScalerKwargs(init_scale=1024.0, growth_interval=1)
    accelerator = kwplug.Accelerator(mixed_precision="fp16", kwargs_handlers=[scaler_handler])
    assert accelerator.device.type == "cuda"
    assert isinstance(accelerator.scaler, torch.amp.GradScaler)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(64, 32, device="cuda")
    y = x[:, :1] * 2
    losses = []
    for _ in range(20):
        with accelerator.autocast():
            out = model(x)
            assert out.dtype == torch.float16  # the Linear ran in half precision
            loss = torch.nn.functional.mse_loss(out.float(), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert next(model.parameters()).dtype == torch.float32  # master weights stay fp32
    assert losses[-1] < losses[0]
    # growth_interval=1: each finite step doubles the scale (from 1024), so it moved
    assert accelerator.scaler.get_scale() != 1024.0


def test_fp16_overflow_skips_the_step() -> None:
    accelerator = kwplug.Accelerator(mixed_precision="fp16")
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    with accelerator.autocast():
        loss = model(torch.full((2, 4), 1e30, device="cuda")).float().sum() * float("inf")
    accelerator.backward(loss)
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_ddp_gets_device_ids() -> None:
    results = run_distributed(gpu_workers.ddp_device_ids, BACKEND, nproc=NPROC, timeout=180)
    for rank, result in enumerate(results):
        assert result["wrapper"] == "DistributedDataParallel"
        assert result["device_index"] == rank % GPUS
        assert result["device_ids"] == [result["device_index"]]
        assert result["identical"] and result["finite"]


@pytest.mark.parametrize("hook", list(HOOKS))
def test_comm_hook_on_nccl(hook: str) -> None:
    results = run_distributed(
        gpu_workers.comm_hook, hook, HOOKS[hook], "no", BACKEND, nproc=NPROC, timeout=180
    )
    expected = {"backend": BACKEND, "wrapped": True, "identical": True, "finite": True}
    for result in results:
        assert result == {**expected, "moved": True}


@pytest.mark.parametrize("hook", ["bf16", "power_sgd"])
def test_comm_hook_with_bf16_autocast_on_nccl(hook: str) -> None:
    results = run_distributed(
        gpu_workers.comm_hook, hook, HOOKS[hook], "bf16", BACKEND, nproc=NPROC, timeout=180
    )
    assert all(r["wrapped"] and r["identical"] and r["finite"] for r in results)


def test_bf16_hook_averages_within_bf16_precision() -> None:
    errors = run_distributed(gpu_workers.bf16_mean, "bf16", BACKEND, nproc=NPROC, timeout=180)
    assert all(0 <= e < 2**-7 for e in errors), errors


def test_profiler_cuda_activity_writes_a_trace_per_rank(tmp_path: Path) -> None:
    results = run_distributed(
        gpu_workers.profile_cuda, str(tmp_path), BACKEND, nproc=NPROC, timeout=180
    )
    assert sorted(r["rank"] for r in results) == list(range(NPROC))
    assert all(r["device_time_us"] > 0 for r in results), results  # GPU kernels were traced
    for rank in range(NPROC):
        trace = tmp_path / f"trace_rank{rank}_step0.json"
        events = json.loads(trace.read_text())["traceEvents"]
        assert any(e.get("cat") == "kernel" for e in events), rank


@two_gpus  # FSDP2's reduce-scatter of CUDA tensors needs nccl, not gloo
@pytest.mark.skipif(importlib.util.find_spec("kwplug_fsdp") is None, reason="kwplug-fsdp absent")
def test_fsdp2_plugin_on_gpu() -> None:
    for result in run_distributed(gpu_workers.fsdp2, BACKEND, nproc=NPROC, timeout=180):
        assert result["dtensor"] and result["finite"] and result["decreased"]
        assert result["device"].startswith("cuda")


@two_gpus
@two_gpus  # one rank per GPU: nccl
@pytest.mark.parametrize("mode", ["fsdp", "tp", "fsdp_tp"])
def test_builtin_fsdp2_and_tensor_parallel_on_nccl(mode: str, tmp_path: Path) -> None:
    if mode == "fsdp_tp" and GPUS < 4:
        pytest.skip("FSDP2 x TP needs 4 GPUs (2 x 2 mesh)")
    nproc = 4 if mode == "fsdp_tp" else 2
    results = run_distributed(
        gpu_workers.builtin_parallel, mode, str(tmp_path / "ckpt"), nproc=nproc, timeout=240
    )
    for result in results:
        assert result["dtensor"] and result["device"].startswith("cuda")
        assert result["finite"] and result["restored"], result


@pytest.mark.skipif(os.geteuid() != 0, reason="the bandwidth benchmark needs root (netns)")
def test_bandwidth_benchmark_on_nccl(tmp_path: Path) -> None:
    out = tmp_path / "bw.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "bandwidth", "--quick", "--rate", "1gbit",
         "--device", "cuda", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert all("ms_per_step" in r for r in rows), rows

"""Per-rank functions of the GPU suite, run by ``kwplug.testing.run_distributed``.

Only kwplug's public API is used (``kwplug.Accelerator``, the handlers exported by ``kwplug``,
``kwplug_fsdp.FullyShardedKwargs``), so the suite survives internal restructuring. Every
function returns plain, picklable facts that the test asserts on.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import kwplug

TIMEOUT_S = 97  # an unusual value, recognisable in the process group's options


def _handlers(backend: str) -> list[Any]:
    # nccl with one GPU per rank; "gloo" (CUDA tensors) when two ranks share one GPU
    return [kwplug.InitProcessGroupKwargs(backend=backend)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )  # fmt: skip


def _batch(device: torch.device, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(32, 64, generator=gen)
    y = torch.randint(0, 10, (32,), generator=gen)
    return x.to(device), y.to(device)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _ranks_identical(flat: torch.Tensor) -> bool:
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


def _train(
    accelerator: kwplug.Accelerator, model: torch.nn.Module, steps: int = 4
) -> tuple[torch.nn.Module, list[float]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for step in range(steps):
        x, y = _batch(accelerator.device, step)
        with accelerator.autocast():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return model, losses


def nccl_process_group() -> dict[str, Any]:
    """An nccl group built from ``InitProcessGroupKwargs(backend="nccl", timeout=97 s)``."""
    handler = kwplug.InitProcessGroupKwargs(backend="nccl", timeout=timedelta(seconds=TIMEOUT_S))
    accelerator = kwplug.Accelerator(kwargs_handlers=[handler])
    value = torch.ones(1, device=accelerator.device) * (dist.get_rank() + 1)
    dist.all_reduce(value)
    group = dist.distributed_c10d._get_default_group()
    backend = group._get_backend(torch.device("cuda"))
    timeout = getattr(getattr(backend, "options", None), "_timeout", None)
    result = {
        "backend": dist.get_backend(),
        "device": str(accelerator.device),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "current_device": torch.cuda.current_device(),
        "sum": float(value),
        "timeout_s": None if timeout is None else timeout.total_seconds(),
    }
    accelerator.end_training()
    return result


def ddp_device_ids(backend: str) -> dict[str, Any]:
    """DDP on the GPU: the wrapper's ``device_ids`` and identical weights after training."""
    accelerator = kwplug.Accelerator(kwargs_handlers=_handlers(backend))
    model, losses = _train(accelerator, _model())
    result = {
        "wrapper": type(model).__name__,
        "device_ids": list(getattr(model, "device_ids", None) or []),
        "device_index": accelerator.device.index,
        "identical": _ranks_identical(_flat(model)),
        "finite": all(map(lambda v: v == v and abs(v) < 1e6, losses)),
    }
    accelerator.end_training()
    return result


def comm_hook(
    hook: str, options: dict[str, Any], mixed_precision: str, backend: str
) -> dict[str, Any]:
    """Train with ``DistributedDataParallelKwargs(comm_hook=hook)`` on ``backend``."""
    handler = kwplug.DistributedDataParallelKwargs(comm_hook=hook, comm_state_option=options)
    accelerator = kwplug.Accelerator(
        mixed_precision=mixed_precision, kwargs_handlers=[handler, *_handlers(backend)]
    )
    model, losses = _train(accelerator, _model(), steps=5)
    flat = _flat(model)
    result = {
        "backend": dist.get_backend(),
        "wrapped": type(model).__name__ == "DistributedDataParallel",
        "identical": _ranks_identical(flat),
        "finite": bool(torch.isfinite(flat).all()) and all(v == v for v in losses),
        "moved": not torch.equal(flat, _flat(_model()).to(flat.device)),
    }
    accelerator.end_training()
    return result


def bf16_mean(hook: str, backend: str) -> float:
    """Max error of the bf16 hook's averaged gradient against the exact fp32 mean."""
    handler = kwplug.DistributedDataParallelKwargs(comm_hook=hook)
    accelerator = kwplug.Accelerator(kwargs_handlers=[handler, *_handlers(backend)])
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Linear(256, 256, bias=False))
    x = torch.randn(8, 256, device=accelerator.device) * (dist.get_rank() + 1)
    accelerator.backward(model(x).square().mean())
    # every rank's gradient, recomputed locally, averaged in fp32: the exact answer
    grads = []
    for rank in range(dist.get_world_size()):
        weight = accelerator.unwrap_model(model).weight.detach().clone().requires_grad_(True)
        torch.manual_seed(0)
        xr = torch.randn(8, 256, device=accelerator.device) * (rank + 1)
        torch.autograd.backward(torch.nn.functional.linear(xr, weight).square().mean())
        grads.append(weight.grad)
    exact = torch.stack(grads).mean(0)
    got = accelerator.unwrap_model(model).weight.grad
    error = float((got.float() - exact).abs().max() / exact.abs().max())
    accelerator.end_training()
    return error


def profile_cuda(trace_dir: str, backend: str) -> dict[str, Any]:
    """``accelerator.profile`` with the cuda activity: per-rank traces holding GPU kernels."""
    handler = kwplug.ProfileKwargs(activities=["cpu", "cuda"], output_trace_dir=trace_dir)
    accelerator = kwplug.Accelerator(kwargs_handlers=[handler, *_handlers(backend)])
    model = accelerator.prepare(_model())
    with accelerator.profile() as prof:
        for step in range(2):
            x, _ = _batch(accelerator.device, step)
            accelerator.backward(model(x).sum())
        torch.cuda.synchronize()
    names = {event.key for event in prof.key_averages()}
    device_time = sum(getattr(e, "device_time_total", 0.0) for e in prof.key_averages())
    accelerator.end_training()
    return {"rank": dist.get_rank(), "ops": len(names), "device_time_us": device_time}


def fsdp2(backend: str) -> dict[str, Any]:
    """The kwplug-fsdp plugin on the GPU: parameters become DTensors; training works."""
    from kwplug_fsdp import FullyShardedKwargs
    from torch.distributed.tensor import DTensor

    shard = FullyShardedKwargs(shard_modules=["Linear"])
    accelerator = kwplug.Accelerator(
        mixed_precision="bf16", kwargs_handlers=[shard, *_handlers(backend)]
    )
    model, losses = _train(accelerator, _model(), steps=4)
    params = list(model.parameters())
    result = {
        "dtensor": all(isinstance(p, DTensor) for p in params),
        "device": str(params[0].device),
        "finite": all(v == v for v in losses),
        "decreased": losses[-1] < losses[0] * 1.5,
    }
    accelerator.end_training()
    return result


#: Tensor-parallel plan of :func:`_model` (``nn.Sequential`` names): hidden layers by columns
#: (outputs gathered), the last by rows.
TP_PLAN = {"0": "colwise_rep", "2": "colwise_rep", "4": "rowwise_rep"}


def builtin_parallel(mode: str, checkpoint_dir: str) -> dict[str, Any]:
    """The built-in ``fsdp``/``parallelism`` plugins on nccl (issue 32): ``mode`` is ``"fsdp"``
    (FSDP2 over every rank), ``"tp"`` (tensor parallelism over every rank) or ``"fsdp_tp"``
    (2-D: 2-way FSDP2 x 2-way TP, 4 GPUs). Trains in bf16, then saves and loads a sharded
    checkpoint through torch.distributed.checkpoint and checks the weights come back."""
    from torch.distributed.tensor import DTensor

    from kwplug import FullyShardedDataParallelPlugin, ParallelismConfig

    world = int(os.environ["WORLD_SIZE"])
    options: dict[str, Any] = {"mixed_precision": "bf16"}
    if mode in ("fsdp", "fsdp_tp"):
        options["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=2)
    if mode == "tp":
        options["parallelism_config"] = ParallelismConfig(tp_size=world, tp_handler=TP_PLAN)
    elif mode == "fsdp_tp":
        options["parallelism_config"] = ParallelismConfig(
            dp_shard_size=world // 2, tp_size=2, tp_handler=TP_PLAN
        )
    accelerator = kwplug.Accelerator(**options)
    model, losses = _train(accelerator, _model(), steps=4)

    def full() -> dict[str, torch.Tensor]:
        return {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu()
            for k, v in accelerator.unwrap_model(model).state_dict().items()
        }

    before = full()
    accelerator.save_state(checkpoint_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.load_state(checkpoint_dir)
    after = full()
    result = {
        "dtensor": any(isinstance(p, DTensor) for p in model.parameters()),
        "device": str(next(model.parameters()).device),
        "finite": all(v == v for v in losses),
        "restored": all(torch.equal(before[k], after[k]) for k in before),
        "mesh": None
        if accelerator.torch_device_mesh is None
        else list(accelerator.torch_device_mesh.mesh_dim_names or ()),
    }
    accelerator.end_training()
    return result

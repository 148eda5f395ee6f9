"""Worker for tests/handlers/test_ddp_torchrun.py: DDP constructor options reaching the DDP module.

Run by torchrun with 2 CPU processes. For each config it builds a fresh Accelerator with a
``DistributedDataParallelKwargs`` handler, prepares a small model (which has a per-rank buffer
and, optionally, a branch the forward never uses), trains 3 steps, and records the DDP module's
attributes, the buffer after construction and training, and the warnings torch gave. Rank 0
prints one line ``KWPLUG_RESULT <json>`` with every rank's records.
"""

from __future__ import annotations

import gc
import json
import warnings
from typing import Any

import torch
import torch.distributed as dist

import kwplug
from kwplug import DistributedDataParallelKwargs


class Net(torch.nn.Module):
    def __init__(self, rank: int, use_all: bool) -> None:
        super().__init__()
        self.used = torch.nn.Linear(8, 4)
        self.unused = torch.nn.Linear(8, 4)
        self.use_all = use_all
        self.register_buffer("marker", torch.full((3,), float(rank + 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.used(x)
        if self.use_all:
            out = out + self.unused(x)
        return out


CONFIGS: list[tuple[str, dict[str, Any], bool]] = [
    ("default", {}, True),
    (
        "custom",
        {
            "bucket_cap_mb": 1,
            "find_unused_parameters": True,
            "broadcast_buffers": False,
            "gradient_as_bucket_view": True,
            "check_reduction": True,
        },
        False,  # the "unused" branch gets no gradient: needs find_unused_parameters=True
    ),
    ("static", {"static_graph": True, "bucket_cap_mb": 0.5}, True),
]


def run_config(kwargs: dict[str, Any], use_all: bool) -> dict[str, Any]:
    handler = DistributedDataParallelKwargs(**kwargs)
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])
    rank = accelerator.process_index
    model = Net(rank, use_all)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)
    marker_after_init = ddp.module.marker.tolist()
    torch.manual_seed(rank)
    for _ in range(3):
        optimizer.zero_grad()
        loss = ddp(torch.randn(5, 8)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
    return {
        "to_kwargs": handler.to_kwargs(),
        "dim": ddp.dim,
        "broadcast_buffers": ddp.broadcast_buffers,
        "bucket_bytes_cap": ddp.bucket_bytes_cap,
        "find_unused_parameters": ddp.find_unused_parameters,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "static_graph": ddp.static_graph,
        "device_ids": ddp.device_ids,
        "marker_after_init": marker_after_init,
        "unused_grad_is_none": ddp.module.unused.weight.grad is None,
        "warnings": [str(w.message) for w in caught],
        "backend": dist.get_backend(),
    }


def main() -> None:
    results: dict[str, Any] = {}
    for name, kwargs, use_all in CONFIGS:
        results[name] = run_config(kwargs, use_all)
    accelerator = kwplug.Accelerator(cpu=True)
    per_rank: list[Any] = [None] * accelerator.num_processes
    dist.all_gather_object(per_rank, results)
    if accelerator.is_main_process:
        print("KWPLUG_RESULT " + json.dumps(per_rank), flush=True)
    # Every DDP module must be gone before the process group is destroyed: one that outlives
    # it (here: in a reference cycle until interpreter exit) sometimes aborts the process at
    # exit ("terminate called without an active exception").
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main()

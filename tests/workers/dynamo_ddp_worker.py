"""``dynamo_backend=`` under DDP, in 2 processes: ``python dynamo_ddp_worker.py LIBRARY BACKEND
FOLDER`` (``kwplug`` or ``accelerate``; ``no`` or ``eager``). Rank 0 prints one
``KWPLUG_RESULT <json>`` line: per rank, what ``prepare`` and ``unwrap_model`` returned, the
losses and the keys ``save_state`` wrote."""

from __future__ import annotations

import gc
import glob
import importlib
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open


def main() -> None:
    library, backend, folder = sys.argv[1:4]
    Accelerator = importlib.import_module(library).Accelerator
    accelerator = Accelerator(cpu=True, dynamo_backend=backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    inner = getattr(prepared, "_orig_mod", prepared)
    generator = torch.Generator().manual_seed(1 + accelerator.process_index)
    x = torch.randn(16, 4, generator=generator)
    y = torch.randn(16, 1, generator=generator)
    losses = []
    for _ in range(4):
        loss = torch.nn.functional.mse_loss(prepared(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # One micro-batch under no_sync: local gradients (they differ per rank) unless the
    # context failed to reach DDP inside the compiled wrapper.
    with accelerator.no_sync(prepared):
        accelerator.backward(torch.nn.functional.mse_loss(prepared(x), y))
    local = [p.grad.flatten().tolist() for p in model.parameters() if p.grad is not None]
    optimizer.zero_grad()
    with accelerator.no_sync(prepared):  # Accelerate's documented use: forward here, ...
        loss = torch.nn.functional.mse_loss(prepared(x), y)
    with accelerator.trigger_sync_in_backward(prepared):  # ... the backward synchronising
        accelerator.backward(loss)
    synced = [p.grad.flatten().tolist() for p in model.parameters() if p.grad is not None]
    optimizer.zero_grad()
    accelerator.save_state(folder)
    # Accelerate's save_state writes on the main process and returns without a barrier: the
    # other ranks wait here before reading what it wrote.
    accelerator.wait_for_everyone()
    (model_file,) = glob.glob(f"{folder}/**/model*.safetensors", recursive=True)
    with safe_open(model_file, "pt") as f:
        keys = sorted(f.keys())
    removed = accelerator.unwrap_model(prepared, keep_torch_compile=False)
    kept = accelerator.unwrap_model(prepared)  # last: Accelerate's reassigns `_orig_mod`
    result: dict[str, Any] = {
        "prepared": type(prepared).__name__,
        "inside": type(inner).__name__,
        "removed_is_model": removed is model,
        "kept": type(kept).__name__,
        "kept_inside_is_model": getattr(kept, "_orig_mod", None) is model,
        "losses": losses,
        "state_keys": keys,
        "weights": [p.detach().flatten().tolist() for p in model.parameters()],
        "no_sync_grads": local,
        "triggered_grads": synced,
    }
    per_rank: list[Any] = [None] * accelerator.num_processes
    dist.all_gather_object(per_rank, result)
    if accelerator.is_main_process:
        print("KWPLUG_RESULT " + json.dumps(per_rank), flush=True)
    del prepared, kept, inner, removed
    gc.collect()  # no DDP module may outlive the process group
    accelerator.end_training()


if __name__ == "__main__":
    main()

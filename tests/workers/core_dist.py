"""Worker for tests/training/test_distributed_core.py: run under torchrun with 2 processes (gloo).

Prints one JSON line per rank: ``RESULT {...}``.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import kwplug
from kwplug import InitProcessGroupKwargs


def pg_facts() -> dict[str, object]:
    pg = dist.group.WORLD
    assert pg is not None
    backend = pg._get_backend(torch.device("cpu"))
    return {
        "backend": dist.get_backend(),
        "timeout_s": backend.options._timeout.total_seconds(),
        "world_size": dist.get_world_size(),
    }


def main() -> None:
    # One process group per launch: torchrun's store keeps the first group's keys.
    configs: dict[str, list[kwplug.KwargsHandler]] = {
        "default": [],
        "gloo_600": [InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=600))],
        "custom_42": [InitProcessGroupKwargs(timeout=42)],
    }
    name = sys.argv[1]
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=configs[name])
    result: dict[str, object] = {**pg_facts(), "num_processes": accelerator.num_processes}
    result["rank"] = accelerator.process_index
    if name != "default":
        accelerator.end_training()
        assert not dist.is_initialized()
        sys.stdout.write("RESULT " + json.dumps(result) + "\n")
        sys.stdout.flush()
        return
    rank = accelerator.process_index
    result["rank"] = rank
    result["is_main"] = accelerator.is_main_process
    result["gather"] = accelerator.gather(torch.tensor([rank, rank * 10])).tolist()
    result["gather_scalar"] = accelerator.gather(torch.tensor(float(rank + 1))).tolist()
    result["sum"] = accelerator.reduce(torch.tensor(float(rank + 1)), "sum").item()
    result["mean"] = accelerator.reduce(torch.tensor(float(rank + 1)), "mean").item()

    dataset = TensorDataset(torch.arange(10))
    torch.manual_seed(1234 + rank)  # different global RNG per rank must not matter
    loader = accelerator.prepare(DataLoader(dataset, batch_size=2, shuffle=True))
    result["epochs"] = [[int(x) for (b,) in loader for x in b] for _ in range(2)]
    result["plain"] = [
        int(x) for (b,) in accelerator.prepare(DataLoader(dataset, batch_size=3)) for x in b
    ]
    accelerator.print("printed-by-main")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())

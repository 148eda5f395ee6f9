"""Worker for tests/checkpoint/test_sharded_dcp_kills.py, run under torchrun in 2 processes:
an FSDP2 model and AdamW whose every tensor (weights, ``exp_avg``, ``exp_avg_sq``) is filled
with the save counter ``n`` before each sharded ``save_state``; rank 0 appends ``n`` to the
acknowledgement file once the save returned. At start it resumes from the checkpoint, if any
(a sharded load in 2 processes). Killed at random instants by the test.

Usage: kill_sharded_saver.py DIR ACK
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import kwplug
from kwplug.checkpoint import _commit as commit


class Counter:
    """The save counter, checkpointed by rank 0 (``custom_0``)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


def build(handlers: list[Any]) -> tuple[Any, nn.Module, Any, Counter]:
    """The Accelerator, model, optimizer (with state) and counter; the same in the checker."""
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=handlers)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    accelerator.backward(model(torch.ones(2, 64)).sum())
    optimizer.step()  # Adam's state exists from here on
    optimizer.zero_grad()
    return accelerator, model, optimizer, counter


def local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor  # a DTensor's shard: a view


def tensors(model: nn.Module, optimizer: Any) -> list[torch.Tensor]:
    """Every tensor the save counter is written into (this rank's part)."""
    found = [local(p) for p in model.parameters()]
    for p in model.parameters():
        found += [local(optimizer.state[p][k]) for k in ("exp_avg", "exp_avg_sq")]
    return found


def main() -> None:
    from kwplug_fsdp import FullyShardedKwargs

    directory, ack = Path(sys.argv[1]), Path(sys.argv[2])
    # torchrun starts each rank in its own session: the test kills the ranks by pid.
    ack.with_name(f"pid_{os.environ['RANK']}").write_text(str(os.getpid()))
    handlers = [FullyShardedKwargs(shard_modules=(nn.Linear,))]
    accelerator, model, optimizer, counter = build(handlers)
    if commit.resolve_checkpoint(directory) is not None:
        accelerator.load_state(str(directory))
    for _ in range(100_000):
        counter.n += 1
        with torch.no_grad():
            for tensor in tensors(model, optimizer):
                tensor.fill_(float(counter.n))
        accelerator.save_state(str(directory))
        if accelerator.is_main_process:
            with ack.open("a") as handle:
                handle.write(f"{counter.n}\n")
                handle.flush()
                os.fsync(handle.fileno())


if __name__ == "__main__":
    main()

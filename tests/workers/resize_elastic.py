"""Worker for tests/checkpoint/test_resize_elastic.py: trains EPOCHS epochs with a checkpoint
every EVERY steps, resuming from the last one on start (at whatever number of processes
torchrun gives it), and records every sample it trains on.

Usage: resize_elastic.py RECORDS CKPT [--hold-at EPOCH BATCH]

Each process appends JSON lines to ``RECORDS/attempt<restart>_rank<rank>.jsonl``:
``{"world": W, "epoch": E, "batch": B, "samples": [...]}`` per step and ``{"saved": [E, B]}``
after each checkpoint. With ``--hold-at``, the first attempt at 2 processes stops after that
step (``RECORDS/hold_<rank>`` holds its pid) until ``RECORDS/go`` exists: the test kills a
node there.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import kwplug
from kwplug import InitProcessGroupKwargs, checkpoint

N, BATCH, EPOCHS, EVERY = 48, 4, 3, 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("records", type=Path)
    parser.add_argument("ckpt")
    parser.add_argument("--hold-at", type=int, nargs=2, default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    group = InitProcessGroupKwargs(timeout=timedelta(seconds=20))
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[group])
    data = TensorDataset(torch.randn(N, 3), torch.randn(N, 1), torch.arange(N))
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=BATCH, shuffle=True)
    )
    if checkpoint.resolve_checkpoint(args.ckpt) is not None:
        accelerator.load_state(args.ckpt, exact_data_position=True)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    world, rank = accelerator.num_processes, accelerator.process_index
    hold = tuple(args.hold_at) if args.hold_at and restart == 0 and world == 2 else None
    path = args.records / f"attempt{restart}_rank{rank}.jsonl"
    steps = 0
    with path.open("a") as records:

        def record(line: dict[str, object]) -> None:
            records.write(json.dumps(line) + "\n")
            records.flush()

        while loader.epoch < EPOCHS:
            epoch = loader.epoch
            for x, y, index in loader:
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
                batch = loader.batches_yielded
                record({"world": world, "epoch": epoch, "batch": batch, "samples": index.tolist()})
                if steps % EVERY == 0:
                    accelerator.save_state(args.ckpt)
                    record({"saved": [epoch, batch]})
                if hold == (epoch, batch):
                    (args.records / f"hold_{rank}").write_text(str(os.getpid()))
                    deadline = time.monotonic() + 60
                    while not (args.records / "go").exists() and time.monotonic() < deadline:
                        time.sleep(0.05)
    accelerator.end_training()


if __name__ == "__main__":
    main()

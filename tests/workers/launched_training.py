"""A training script started by ``kwplug launch`` or ``accelerate launch`` (the library is the
one named by ``LAUNCH_LIBRARY``: ``kwplug`` or ``accelerate``); it builds ``Accelerator()``
without arguments, so every setting comes from the launcher.

Usage: ``launched_training.py OUT_DIR``. Each rank writes ``OUT_DIR/rank<i>.json`` (the
settings it got, ``str(accelerator.device)``, ``str(accelerator.state)``); the main process
writes the trained weights to ``OUT_DIR/weights.pt``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

if os.environ.get("LAUNCH_LIBRARY") == "accelerate":
    from accelerate import Accelerator
else:
    from kwplug import Accelerator


def main() -> None:
    out = Path(sys.argv[1])
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 6, generator=generator), torch.randn(48, 2))
    loader = DataLoader(data, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps = 0
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps += int(accelerator.sync_gradients)
    record = {
        "process_index": accelerator.process_index,
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
        "distributed_type": str(accelerator.distributed_type),
        "device": str(accelerator.device),
        "state": str(accelerator.state),
        "optimizer_steps": steps,
    }
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        weights = accelerator.unwrap_model(model).state_dict()
        torch.save({k: v.detach().clone() for k, v in weights.items()}, out / "weights.pt")


if __name__ == "__main__":
    main()

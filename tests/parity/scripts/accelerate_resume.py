# A user switching from Accelerate to kwplug mid-training (issue 28, item 4): the run is saved
# by Accelerate (`--save`), then resumed from that folder, by Accelerate and by the copy of this
# script with its imports renamed (tests/parity/test_accelerate_resume.py). The script has
# everything Accelerate's save_state writes: a DDP model with dropout, AdamW, a prepared
# StepLR, a registered object, gradient accumulation saved mid-window (Accelerate's `step`),
# the RNG states of Python, NumPy and torch (drawn from right after the load) and a shuffled
# loader. Each rank writes what it saw to `<record>.rank<i>.pt`.
import argparse
import random

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


class Progress:
    """A registered object (custom_checkpoint_0.pkl): a count and a tensor."""

    def __init__(self):
        self.batches = 0
        self.loss_sum = torch.zeros(())

    def state_dict(self):
        return {"batches": self.batches, "loss_sum": self.loss_sum.clone()}

    def load_state_dict(self, state):
        self.batches = state["batches"]
        self.loss_sum = state["loss_sum"].clone()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    set_seed(7, device_specific=True)  # each rank its own RNG states
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    data = TensorDataset(torch.arange(64).float().unsqueeze(1).repeat(1, 4) / 64, torch.arange(64))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    record = {"trained": [], "sync": []}
    if not args.save:
        accelerator.load_state(args.checkpoint)
        record["draws"] = {
            "torch": torch.rand(4),
            "numpy": torch.from_numpy(np.random.rand(4)),
            "python": torch.tensor([random.random() for _ in range(4)]),
        }
    for epoch in range(2):
        for batch, (x, ids) in enumerate(loader):
            with accelerator.accumulate(model):
                loss = model(x).pow(2).mean()
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            record["trained"].append(ids.tolist())
            record["sync"].append(accelerator.sync_gradients)
            progress.batches += 1
            progress.loss_sum += loss.detach()
            if args.save and epoch == 1 and batch == 4:  # mid-window: step 5 of 2-step windows
                accelerator.save_state(args.checkpoint)
                return
    record["weights"] = {
        k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()
    }
    record["optimizer"] = optimizer.optimizer.state_dict()
    record["scheduler"] = scheduler.scheduler.state_dict()
    record["progress"] = progress.state_dict()
    torch.save(record, f"{args.record}.rank{accelerator.process_index}.pt")


if __name__ == "__main__":
    main()

"""Worker for tests/training/test_join_and_sync.py (issue 17, divergence 3): train under
``join_uneven_inputs`` on uneven shares, then evaluate a loader with uneven batch counts per
rank (``even_batches=False``) and gather. Under torchrun with 2 processes (gloo).

Before the fix the DDP model stayed in join mode after the context: each evaluation forward
was an all-reduce, so the rank with more batches waited for a partner that was already in the
gather -- a hang. Prints ``RESULT {...}`` per rank.
"""

from __future__ import annotations

import json

import torch
from torch.utils.data import DataLoader, TensorDataset

import kwplug
from kwplug.utils import DataLoaderConfiguration


def main() -> None:
    accelerator = kwplug.Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False)
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    data = TensorDataset(torch.randn(7, 4), torch.randn(7, 1))  # 4 and 3 batches of 1
    train = accelerator.prepare(DataLoader(data, batch_size=1))
    evaluate = accelerator.prepare(DataLoader(data, batch_size=1))
    steps = 0
    with accelerator.join_uneven_inputs([model]):
        for x, y in train:
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    model.eval()
    predictions = []
    with torch.no_grad():
        for x, _ in evaluate:
            predictions.append(model(x))
    gathered = accelerator.gather(torch.tensor([len(predictions)]))
    # And training goes on after evaluation, unjoined, on even batches.
    model.train()
    x = torch.ones(2, 4)
    accelerator.backward(model(x).sum())
    grad = model.module[0].weight.grad.detach().clone()
    grads = accelerator.gather(grad[None])
    result = {
        "rank": accelerator.process_index,
        "steps": steps,
        "evaluated": gathered.tolist(),
        "join_enabled_after": model._join_config.enable,
        "grads_equal": bool(torch.equal(grads[0], grads[1])),
    }
    print("RESULT " + json.dumps(result), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()

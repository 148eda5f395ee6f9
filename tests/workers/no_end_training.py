"""A training script that never calls accelerator.end_training() (as many users' do not)."""

import torch

import kwplug

accelerator = kwplug.Accelerator(
    kwargs_handlers=[kwplug.DistributedDataParallelKwargs(comm_hook="bf16")]
)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
for _ in range(20):
    accelerator.backward(model(torch.randn(32, 64)).square().mean())
    optimizer.step()
    optimizer.zero_grad()
print("done", accelerator.process_index)

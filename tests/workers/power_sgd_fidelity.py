"""Worker for tests/handlers/test_power_sgd_fidelity.py, written against Accelerate.

The test runs it as it is (Accelerate) and with its imports renamed (kwplug), in 2 CPU
processes. For each PowerSGD configuration it trains a small MLP on rank-specific data, with
compression from the third step, and rank 0 prints
``POWER_SGD_RESULT <json>``: per configuration the sha256 of the final ``state_dict`` (keys,
dtypes, shapes and bytes in key order), the loss of each step and the hook's compression
counters.

The MLP's gradients fill one DDP bucket, which DDP rebuilds in gradient-ready order (the
reverse of ``model.parameters()``) after the first step: the layout PowerSGD's state is built
in. With several buckets on gloo, PowerSGD hangs under Accelerate (collectives issued from
completion callbacks in a different order on each rank), so it cannot be the reference there;
tests/handlers/test_canonical_bucket.py compares bucket by bucket with torch's hook instead.
"""

import argparse
import hashlib
import json

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

STEPS = 10
#: configuration -> (comm_hook, comm_wrapper). No reference exists here for the others: torch
#: 2.13's own ``batched_powerSGD_hook``, which Accelerate registers for ``batched_power_sgd``,
#: fails at its first compressed step, and torch refuses the bf16 wrapper on gloo.
CONFIGS = {
    "power_sgd": (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.NO),
    "power_sgd+fp16": (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.FP16),
}


def digest(model: torch.nn.Module) -> str:
    sha = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        sha.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        sha.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def train(comm_hook: DDPCommunicationHookType, comm_wrapper: DDPCommunicationHookType) -> dict:
    handler = DistributedDataParallelKwargs(
        comm_hook=comm_hook,
        comm_wrapper=comm_wrapper,
        comm_state_option={"start_powerSGD_iter": 2, "matrix_approximation_rank": 2},
    )
    accelerator = Accelerator(cpu=True, kwargs_handlers=[handler])
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 96),
        torch.nn.ReLU(),
        torch.nn.Linear(96, 96),
        torch.nn.ReLU(),
        torch.nn.Linear(96, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 4),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = torch.Generator().manual_seed(100 + accelerator.process_index)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(16, 32, generator=data)
        y = torch.randn(16, 4, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = model._comm_hooks[0][1] if getattr(model, "_comm_hooks", None) else None
    counters = (
        [state.total_numel_before_compression, state.total_numel_after_compression]
        if state is not None and hasattr(state, "total_numel_before_compression")
        else None
    )
    return {
        "digest": digest(accelerator.unwrap_model(model)),
        "losses": losses,
        "counters": counters,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args()
    results = {name: train(*CONFIGS[name]) for name in args.configs.split(",")}
    if dist.get_rank() == 0:
        print("POWER_SGD_RESULT " + json.dumps(results), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()

"""Worker for tests/checkpoint/test_reliability.py: trains with periodic checkpoints and
resumes from the last one on start, so torchrun --max-restarts can restart it after a worker dies.

Usage: elastic.py OUT CKPT --steps N --every K [--kill-rank R --kill-at S] [--comm-hook H]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import kwplug
from kwplug import DistributedDataParallelKwargs, InitProcessGroupKwargs, checkpoint


class StepCounter:
    """A checkpointable training-step counter."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("ckpt")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--comm-hook", default="no")
    parser.add_argument("--raise-rank", type=int, default=-1)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()

    torch.manual_seed(0)
    options = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
    accelerator = kwplug.Accelerator(
        cpu=True,
        kwargs_handlers=[
            DistributedDataParallelKwargs(
                comm_hook=args.comm_hook,
                comm_state_option=options if "power_sgd" in args.comm_hook else {},
            ),
            InitProcessGroupKwargs(timeout=args.timeout),
        ],
    )
    data = TensorDataset(torch.randn(96, 10), torch.randn(96, 1))
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if checkpoint.resolve_checkpoint(args.ckpt) is not None:
        accelerator.load_state(args.ckpt, exact_data_position=True)
        accelerator.print(f"resumed at step {counter.step} (restart {restart})")
    sys.stdout.write(f"rank {accelerator.process_index} training\n")
    sys.stdout.flush()

    while counter.step < args.steps:
        for x, y in loader:
            if (
                restart == 0
                and accelerator.process_index == args.kill_rank
                and counter.step == args.kill_at
            ):
                os.kill(os.getpid(), signal.SIGKILL)  # the injected fault
            if accelerator.process_index == args.raise_rank and counter.step == args.kill_at:
                raise RuntimeError(f"user code failed on rank {accelerator.process_index}")
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            counter.step += 1
            if counter.step % args.every == 0:
                accelerator.save_state(args.ckpt)
            if counter.step == args.steps:
                break
    params = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    gathered = accelerator.gather(params.unsqueeze(0))
    assert torch.equal(gathered[0], gathered[-1]), "ranks disagree"
    if accelerator.is_main_process:
        torch.save(params, args.out)
    accelerator.end_training()


if __name__ == "__main__":
    main()

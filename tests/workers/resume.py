"""Worker for tests/checkpoint/test_checkpoint.py: train, save, resume, and write final parameters.

Usage: resume.py OUT --steps N [--save-at K --ckpt DIR] [--resume DIR --start-step K]
                 [--mixed-precision fp16] [--comm-hook power_sgd] [--comm-wrapper fp16]
                 [--gradient-as-bucket-view] [--crash-in-save] [--model buckets --bucket-cap-mb MB]
                 [--start-iter N] [--no-error-feedback] [--no-warm-start]
Runs single-process or under torchrun.
"""

from __future__ import annotations

import argparse
import os
import random

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

import kwplug
from kwplug import DistributedDataParallelKwargs
from kwplug.checkpoint import _commit as commit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-at", type=int, default=-1)
    parser.add_argument("--ckpt")
    parser.add_argument("--resume")
    parser.add_argument("--start-step", type=int, default=0)
    parser.add_argument("--mixed-precision", default="no")
    parser.add_argument("--comm-hook", default="no")
    parser.add_argument("--comm-wrapper", default="no")
    parser.add_argument("--gradient-as-bucket-view", action="store_true")
    parser.add_argument("--crash-in-save", action="store_true")
    parser.add_argument("--model", choices=["mlp", "buckets"], default="mlp")
    parser.add_argument("--bucket-cap-mb", type=float)
    # PowerSGD's start_powerSGD_iter, use_error_feedback and warm_start.
    parser.add_argument("--start-iter", type=int, default=2)
    parser.add_argument("--no-error-feedback", action="store_true")
    parser.add_argument("--no-warm-start", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    options = {
        "matrix_approximation_rank": 1,
        "start_powerSGD_iter": args.start_iter,
        "use_error_feedback": not args.no_error_feedback,
        "warm_start": not args.no_warm_start,
    }
    ddp = DistributedDataParallelKwargs(
        comm_hook=args.comm_hook,
        comm_state_option=options if "power_sgd" in args.comm_hook else {},
        comm_wrapper=args.comm_wrapper,
        gradient_as_bucket_view=args.gradient_as_bucket_view,
        **({"bucket_cap_mb": args.bucket_cap_mb} if args.bucket_cap_mb else {}),
    )
    accelerator = kwplug.Accelerator(
        mixed_precision=args.mixed_precision, cpu=True, kwargs_handlers=[ddp]
    )
    data = TensorDataset(torch.randn(64, 12), torch.randn(64, 1))
    if args.model == "buckets":
        # With --bucket-cap-mb 0.001, DDP's rebuilt buckets are (5, 4, 3), (2,), (1, 0) by
        # index in model.parameters(): the second Linear's weight fills one alone, and lies
        # 650 elements (2,600 bytes) into DDP's initial single bucket.
        model = torch.nn.Sequential(
            torch.nn.Linear(12, 50),
            torch.nn.ReLU(),
            torch.nn.Linear(50, 50, bias=False),
            torch.nn.ReLU(),
            torch.nn.Linear(50, 50, bias=False),
            torch.nn.ReLU(),
            torch.nn.Linear(50, 1),
        )
    else:
        model = torch.nn.Sequential(
            torch.nn.Linear(12, 32),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(32, 1),
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if args.resume:
        accelerator.load_state(args.resume, exact_data_position=True)

    step = args.start_step
    while step < args.steps:
        for x, y in loader:
            noise = torch.randn(1).item() * 1e-3 + random.random() * 1e-3 + np.random.rand() * 1e-3
            with accelerator.autocast():
                loss = torch.nn.functional.mse_loss(model(x).float(), y) + noise
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == args.save_at:
                if args.crash_in_save:

                    def crash_before_marker(step: str) -> None:
                        if step == "mark":  # every file and the manifest are written
                            os._exit(17)

                    commit.reached = crash_before_marker
                accelerator.save_state(args.ckpt)
            if step == args.steps:
                break
    params = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    if accelerator.is_main_process:
        torch.save(params, args.out)
    accelerator.end_training()


if __name__ == "__main__":
    main()

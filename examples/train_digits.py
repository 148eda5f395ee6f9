"""Train a small MLP on scikit-learn's bundled digits with kwplug -- the end-to-end example.

The data set is ``sklearn.datasets.load_digits()`` (1,797 8x8 grey-scale images of the digits
0-9, shipped inside scikit-learn: nothing is downloaded). A fixed, stratified 20% is held out
for evaluation; the rest is sharded across the processes by ``accelerator.prepare_data_loader``.

Single process (CPU, or the GPU when there is one)::

    python examples/train_digits.py
    python examples/train_digits.py --mixed-precision bf16
    python examples/train_digits.py --mixed-precision fp16      # with a GradScaler
    python examples/train_digits.py --log-with tensorboard    # then: tensorboard --logdir runs
    python examples/train_digits.py --log-with wandb          # offline run in runs/wandb
    python examples/train_digits.py --log-with mlflow         # file store in runs/mlruns

Two processes on the CPU (gloo), gradients all-reduced in bfloat16, the first training steps
profiled (each rank writes one Chrome trace into ``traces/``, open it in chrome://tracing or
https://ui.perfetto.dev)::

    python -m torch.distributed.run --nproc-per-node 2 examples/train_digits.py \\
        --comm-hook bf16 --mixed-precision bf16 --profile-dir traces

With ``--config FILE`` the Accelerator's settings and handlers come from a TOML file (see
``Accelerator.from_config``), so a handler plugin is used by its entry-point name, without
importing it. ``examples/fsdp.toml`` shards the model with FSDP2 instead of DDP (needs
``pip install -e examples/plugins/kwplug-fsdp``)::

    python -m torch.distributed.run --nproc-per-node 2 examples/train_digits.py \\
        --config examples/fsdp.toml

With ``--checkpoint-dir DIR`` the state is saved atomically after every epoch and a restarted
run resumes from it, so ``torchrun --max-restarts 3 --rdzv-backend c10d
--rdzv-endpoint 127.0.0.1:29500 ...`` survives a worker that dies.

Every handler here is optional: without ``kwargs_handlers`` the Accelerator uses each handler's
defaults. The ones passed show where the knobs are.

Output: one line per epoch (mean training loss over all ranks, held-out accuracy), then --
in distributed runs -- ``ranks_identical=True`` once the flat parameter vectors of all ranks
were gathered and compared, and last a machine-readable ``final_accuracy=0.9xxx``. The script
exits with status 1 if the ranks' weights differ.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import attrs
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from kwplug import (
    Accelerator,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    checkpoint,
)
from kwplug.config import load_config

COMM_HOOKS = ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd")

# Profile a few steps at the start of training: wait 1 step, warm up 1, record 3, once.
# ``repeat=1`` makes each rank write exactly one trace.
PROFILE_SCHEDULE = {"wait": 1, "warmup": 1, "active": 3, "repeat": 1}


class _DefaultsHelp(argparse.HelpFormatter):
    """Appends an option's default to its help, unless the help says it already or the
    option has none (``None``): argparse's own formatter wrote both, e.g. "(default: the
    --config file's, else no) (default: None)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a small MLP on scikit-learn's digits with kwplug.",
        formatter_class=_DefaultsHelp,
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="TOML file for Accelerator.from_config (mixed_precision, cpu, [handlers.<name>] "
        "tables); its handlers replace the script's of the same class, flags given here win",
    )
    # None: not given, so that a --config file can set it (resolved in make_accelerator).
    parser.add_argument(
        "--mixed-precision",
        choices=("no", "bf16", "fp16"),
        default=None,
        help="(default: the --config file's, else no)",
    )
    parser.add_argument(
        "--comm-hook",
        default=None,
        metavar="NAME",
        help=f"DDP gradient communication hook, only used with more than one process: "
        f"{', '.join(COMM_HOOKS)}, or a name a plugin contributes (int8, topk with "
        "kwplug-compress installed) (default: the --config file's [handlers.ddp], else no)",
    )
    parser.add_argument(
        "--profile-dir",
        default=None,
        help="profile the first training steps; each rank writes one Chrome trace here",
    )
    parser.add_argument(
        "--log-with",
        default=None,
        metavar="TRACKER",
        help="log train_loss/test_accuracy per epoch: tensorboard, wandb, mlflow, comet_ml, "
        "aim (each needs its kwplug[...] extra), jsonl, all, or a name a tracker plugin "
        "contributes; files go to --project-dir. Offline unless the environment says "
        "otherwise: wandb with WANDB_MODE=offline in <project-dir>/wandb (unless WANDB_MODE "
        "or WANDB_API_KEY is set), mlflow in the file store <project-dir>/mlruns (unless "
        "MLFLOW_TRACKING_URI is set), comet_ml as an offline archive in <project-dir>/comet "
        "(unless COMET_API_KEY is set), aim in the repository <project-dir>/.aim",
    )
    parser.add_argument(
        "--project-dir", default="runs", help="where trackers write (<dir>/train_digits)"
    )
    parser.add_argument("--epochs", type=int, default=12, help="passes over the training split")
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save the training state there after every epoch and resume from it on start "
        "(e.g. after torchrun --max-restarts restarts a failed worker)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument(
        "--lr", type=float, default=1e-2, help="AdamW learning rate (cosine-annealed)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="the data split, initial weights and shuffle order"
    )
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.lr <= 0:
        parser.error("--epochs and --batch-size must be >= 1 and --lr > 0")
    return args


def load_data(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """The digits, pixels scaled to [0, 1], split 80/20 (stratified, fixed by ``seed``)."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        range(len(y)), test_size=0.2, random_state=seed, stratify=digits.target
    )
    train = TensorDataset(x[train_idx], y[train_idx])
    test = TensorDataset(x[test_idx], y[test_idx])
    return train, test


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


@torch.no_grad()
def evaluate(accelerator: Accelerator, model: nn.Module, data: TensorDataset) -> float:
    """Accuracy of ``model`` on all of ``data`` (every rank computes the same number)."""
    model.eval()
    x, y = (t.to(accelerator.device) for t in data.tensors)
    with accelerator.autocast():
        logits = model(x)
    model.train()
    return (logits.argmax(dim=1) == y).float().mean().item()


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """Every parameter, flattened; sharded (FSDP2 ``DTensor``) ones all-gathered in full, so
    every rank must call it."""
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return torch.cat([p.detach().float().reshape(-1) for p in full])


class Progress:
    """The number of finished epochs, saved with the checkpoint."""

    def __init__(self) -> None:
        self.epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = state["epoch"]


def make_accelerator(args: argparse.Namespace) -> Accelerator:
    handlers: list[KwargsHandler] = [
        # Gradients are all-reduced through the chosen communication hook (under torchrun).
        DistributedDataParallelKwargs(comm_hook=args.comm_hook or "no"),
        # Only used with --mixed-precision fp16: start at a smaller loss scale than 2**16.
        GradScalerKwargs(init_scale=1024.0, growth_interval=100),
        # Only used under torchrun: fail fast instead of hanging 30 minutes on a dead peer.
        InitProcessGroupKwargs(timeout=timedelta(seconds=120)),
    ]
    tracking = {"log_with": args.log_with, "project_dir": args.project_dir}
    if args.config is None:
        return Accelerator(
            mixed_precision=args.mixed_precision or "no",
            cpu=args.cpu,
            kwargs_handlers=handlers,
            **tracking,
        )
    # What Accelerator.from_config(args.config, **overrides) does, with the handler lists
    # merged: the file's handlers (any plugin, by entry-point name) replace the script's of
    # the same class, and flags given on the command line win over the file.
    configured = load_config(args.config)  # ConfigError names the file, table and key
    from_file: list[KwargsHandler] = configured["kwargs_handlers"]
    if args.comm_hook is not None:
        from_file = [
            attrs.evolve(h, comm_hook=args.comm_hook)
            if isinstance(h, DistributedDataParallelKwargs)
            else h
            for h in from_file
        ]
    configured_classes = {type(h) for h in from_file}
    configured["kwargs_handlers"] = [
        *from_file,
        *(h for h in handlers if type(h) not in configured_classes),
    ]
    if args.mixed_precision is not None:
        configured["mixed_precision"] = args.mixed_precision
    if args.cpu:
        configured["cpu"] = True
    return Accelerator(**configured, **tracking)


def describe_comm_hook(accelerator: Accelerator) -> str:
    """The communication hook of the DDP handler in use."""
    for handler in accelerator.handlers:
        if isinstance(handler, DistributedDataParallelKwargs):
            return str(handler.comm_hook)
    return "no"


def train(accelerator: Accelerator, args: argparse.Namespace) -> tuple[float, bool]:
    """Train, print one line per epoch; return the final held-out accuracy and whether all
    ranks ended with identical weights."""
    # Same seed on every rank: identical initial weights (DDP would also broadcast rank 0's).
    torch.manual_seed(args.seed)
    train_set, test_set = load_data(args.seed)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)

    model, optimizer = accelerator.prepare(model, optimizer)
    if args.config is not None:  # which plugin wrapped the model (DDP, FSDP, ... or none)
        accelerator.print(f"wrap_model: {accelerator.plan['wrap_model'].plugin or 'unwrapped'}")
    # Shards the loader per rank; the seed fixes the (per-epoch) shuffle on every rank.
    train_loader = accelerator.prepare_data_loader(train_loader, seed=args.seed)
    # Cosine decay over all steps: a calm end of training, so the final accuracy is stable.
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=args.epochs * len(train_loader)
    )
    loss_fn = nn.CrossEntropyLoss()
    progress = Progress()
    if args.checkpoint_dir is not None:
        # Saved and restored with the model, optimizer, RNGs and data position.
        accelerator.register_for_checkpointing(scheduler, progress)
        if checkpoint.resolve_checkpoint(args.checkpoint_dir) is not None:
            accelerator.load_state(args.checkpoint_dir)
            accelerator.print(f"resumed from {args.checkpoint_dir} after epoch {progress.epoch}")

    profiling: Any = contextlib.nullcontext()
    if args.profile_dir is not None:
        profiling = accelerator.profile(
            ProfileKwargs(schedule_option=PROFILE_SCHEDULE, output_trace_dir=args.profile_dir)
        )

    # Trackers exist on the main process only; elsewhere these calls do nothing.
    config = {"lr": args.lr, "batch_size": args.batch_size, "epochs": args.epochs}
    accelerator.init_trackers("train_digits", config=config)
    show_bar = accelerator.is_main_process and not args.no_progress
    accuracy = 0.0
    start = time.perf_counter()
    with profiling as prof:
        for epoch in range(progress.epoch, args.epochs):
            total = torch.zeros((), device=accelerator.device)
            batches = 0
            # disable=None: tqdm hides itself when stderr is not a terminal.
            bar = tqdm(
                train_loader,
                desc=f"epoch {epoch + 1}/{args.epochs}",
                leave=False,
                disable=None if show_bar else True,
            )
            for inputs, targets in bar:
                with accelerator.autocast():
                    loss = loss_fn(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                total += loss.detach().float()
                batches += 1
                if prof is not None:
                    prof.step()
            bar.close()
            # Every rank has the same number of batches (the sampler pads the shards).
            mean_loss = accelerator.reduce(total / max(batches, 1), "mean").item()
            accuracy = evaluate(accelerator, accelerator.unwrap_model(model), test_set)
            accelerator.print(
                f"epoch {epoch + 1:>3}  train_loss={mean_loss:.4f}  test_accuracy={accuracy:.4f}"
            )
            metrics = {"train_loss": mean_loss, "test_accuracy": accuracy}
            accelerator.log(metrics, step=epoch + 1)
            progress.epoch = epoch + 1
            if args.checkpoint_dir is not None:
                accelerator.save_state(args.checkpoint_dir)  # atomic: all or nothing
    accelerator.print(f"trained in {time.perf_counter() - start:.1f}s")

    identical = True
    if accelerator.distributed:
        flat = flat_parameters(accelerator.unwrap_model(model))
        gathered = accelerator.gather(flat).view(accelerator.num_processes, -1)
        identical = all(torch.equal(gathered[0], row) for row in gathered[1:])
        accelerator.print(f"ranks_identical={identical}")
    return accuracy, identical


def offline_tracking(log_with: str | None, project_dir: str) -> None:
    """Keep wandb, mlflow and comet_ml runs on this machine unless the environment says
    otherwise."""
    if log_with not in ("wandb", "mlflow", "comet_ml", "all"):
        return
    if log_with in ("comet_ml", "all") and "COMET_API_KEY" not in os.environ:
        os.environ.setdefault("COMET_START_ONLINE", "false")  # upload later: comet upload
        os.environ.setdefault("COMET_OFFLINE_DIRECTORY", os.path.join(project_dir, "comet"))
    if log_with in ("wandb", "all") and not ({"WANDB_MODE", "WANDB_API_KEY"} & os.environ.keys()):
        os.environ["WANDB_MODE"] = "offline"  # upload later: wandb sync <run folder>
        os.environ.setdefault("WANDB_DIR", project_dir)
        os.makedirs(project_dir, exist_ok=True)
    if log_with in ("mlflow", "all") and "MLFLOW_TRACKING_URI" not in os.environ:
        store = os.path.abspath(os.path.join(project_dir, "mlruns"))
        os.environ["MLFLOW_TRACKING_URI"] = "file:" + store
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    offline_tracking(args.log_with, args.project_dir)
    accelerator = make_accelerator(args)
    accelerator.print(
        f"{accelerator.num_processes} process(es) on {accelerator.device}, "
        f"mixed_precision={accelerator.mixed_precision}, "
        f"comm_hook={describe_comm_hook(accelerator)}"
    )
    accuracy, identical = train(accelerator, args)
    accelerator.print(f"final_accuracy={accuracy:.4f}")
    # The model trained in train() is unreachable now; end_training() finishes the trackers
    # and collects the model (DDP's reducer) before destroying the process group.
    accelerator.end_training()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())

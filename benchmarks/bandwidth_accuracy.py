"""``python -m benchmarks bandwidth --time-to-accuracy --rate 100mbit``: wall time to 95%
held-out accuracy on scikit-learn's digits, 2 ranks, kwplug, per communication hook.

The model, split and optimiser are those of ``examples/train_digits.py``'s defaults: the
64-128-64-10 MLP, a stratified 20% held out (``random_state=0``), SGD (lr 0.1, momentum 0.9),
batch 32 per rank, each rank training on every second sample. Every 10 steps rank 0 evaluates
the held-out set and broadcasts whether 95% is reached; the clock (started after a barrier)
includes those evaluations. Run inside :class:`benchmarks.bandwidth.Namespace` by
:func:`run`; this module is also the per-rank worker.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

TARGET = 0.95
EVAL_EVERY = 10
MAX_STEPS = 3000
HOOKS: dict[str, dict[str, Any]] = {
    "no": {},
    "fp16": {},
    "bf16": {},
    "power_sgd": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 10},
    "int8": {},
    "topk": {"ratio": 0.05},
}


def _data() -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    split = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    return tuple(split)


def time_to_accuracy(hook: str) -> dict[str, Any]:
    """Train with ``comm_hook=hook`` until :data:`TARGET` held-out accuracy (one rank's view)."""
    import kwplug

    x_train, x_test, y_train, y_test = _data()
    handler = kwplug.DistributedDataParallelKwargs(comm_hook=hook, comm_state_option=HOOKS[hook])
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(0)
    plain = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )  # fmt: skip
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    model, opt = accelerator.prepare(plain, opt)
    shard_x, shard_y = x_train[rank::world], y_train[rank::world]
    per_epoch = len(shard_y) // 32
    gen = torch.Generator().manual_seed(rank)
    order = torch.randperm(len(shard_y), generator=gen)
    accuracy, done = 0.0, torch.zeros(1)
    dist.barrier()
    start = time.perf_counter()
    step = 0
    while step < MAX_STEPS:
        if step % per_epoch == 0:
            order = torch.randperm(len(shard_y), generator=gen)
        index = order[(step % per_epoch) * 32 : (step % per_epoch + 1) * 32]
        loss = torch.nn.functional.cross_entropy(model(shard_x[index]), shard_y[index])
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        step += 1
        if step % EVAL_EVERY == 0:
            if rank == 0:
                with torch.no_grad():
                    predicted = accelerator.unwrap_model(model)(x_test).argmax(1)
                accuracy = float((predicted == y_test).float().mean())
                done.fill_(float(accuracy >= TARGET))
            dist.broadcast(done, 0)
            if done.item():
                break
    seconds = time.perf_counter() - start
    return {
        "hook": hook,
        "steps": step,
        "seconds": seconds if done.item() else None,
        "accuracy": accuracy,
        "ms_per_step": seconds / step * 1e3,
    }


def run(ns: Any, launch: Callable[..., Any], rate: str, quick: bool, out: str | None) -> int:
    """Launch the workers in ``ns`` and print the table; the exit status."""
    hooks = ["no", "fp16", "int8"] if quick else list(HOOKS)
    data, error = launch(ns, "benchmarks.bandwidth_accuracy", ["--hooks", ",".join(hooks)], 900)
    if data is None:
        print(f"time-to-accuracy failed: {error}")
        return 1
    lines = [
        f"### time to {TARGET:.0%} held-out accuracy, digits MLP, 2 ranks, loopback {rate}",
        "",
        "| hook | seconds | steps | ms/step | accuracy reached |",
        "|---|---|---|---|---|",
    ]
    for r in data["results"]:
        seconds = "not reached" if r["seconds"] is None else f"{r['seconds']:.2f}"
        lines.append(
            f"| {r['hook']} | {seconds} | {r['steps']} | {r['ms_per_step']:.1f} "
            f"| {r['accuracy']:.3f} |"
        )
    print("\n".join(lines))
    if out:
        with open(out, "w", encoding="utf-8") as handle:
            json.dump({"rate": rate, **data}, handle, indent=2)
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    """Per-rank entry point under torchrun."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--hooks", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    results = []
    for hook in args.hooks.split(","):
        try:
            results.append(time_to_accuracy(hook))
        except Exception as exc:
            results.append({"hook": hook, "steps": 0, "seconds": None, "accuracy": 0.0,
                            "ms_per_step": 0.0, "error": repr(exc)[:200]})  # fmt: skip
    if dist.get_rank() == 0:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump({"results": results}, handle, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

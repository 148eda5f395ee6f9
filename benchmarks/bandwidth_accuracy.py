"""``python -m benchmarks bandwidth --time-to-accuracy --rate 100mbit``: wall time and steps to
95% held-out accuracy on scikit-learn's digits, 2 ranks, raw DDP vs Accelerate vs kwplug, per
communication hook.

The model, split and optimiser are those of ``examples/train_digits.py``'s defaults: the
64-128-64-10 MLP (``--width 128``; ``--width W`` makes it 64-W-W/2-10, so that the link
matters), a stratified 20% held out (``random_state=0``), SGD (lr 0.1, momentum 0.9), batch
32 per rank, each rank training on every second sample. Every :data:`EVAL_EVERY` steps rank 0
evaluates the held-out set and broadcasts whether 95% is reached; the clock (started after a
barrier) includes those evaluations. Every (system, hook) pair starts from the same weights
and sees the same batches.

Systems, as in :mod:`benchmarks.bandwidth_systems`: ``raw`` is torch's DDP with torch's hook
functions registered by hand (kwplug-compress's for int8/top-k, which torch lacks; torch's
``PeriodicModelAverager`` for local SGD), ``accelerate`` its ``DistributedDataParallelKwargs``
and ``LocalSGD``, ``kwplug`` its own. Each system runs in a launch of its own, torch's
PowerSGD (which aborts the process on gloo) in one per hook, so one failure costs one row.
Run inside :class:`benchmarks.bandwidth.Namespace` by :func:`run`; this module is also the
per-rank worker.
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._tta_train import EVAL_EVERY, TARGET, train

HOOKS: dict[str, dict[str, Any]] = {
    "no": {},
    "fp16": {},
    "bf16": {},
    "power_sgd": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 10},
    "power_sgd_inplace": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 10},
    "int8": {},
    "topk": {"ratio": 0.1},
    "local_sgd": {},
}
SYSTEMS = ("raw", "accelerate", "kwplug")
#: Accelerate has no int8/top-k/power_sgd_inplace hook.
UNSUPPORTED = frozenset({"accelerate:int8", "accelerate:topk", "accelerate:power_sgd_inplace"})
#: torch's PowerSGD hook aborts the process on gloo: a launch of its own.
ALONE = frozenset({"raw:power_sgd", "accelerate:power_sgd"})
#: Seconds a lone torch PowerSGD launch may take: on gloo it aborts, or hangs in a collective.
ALONE_TIMEOUT_S = 240.0
QUICK = ("raw:no", "kwplug:no", "kwplug:fp16")
#: Steps to the target may be at most this multiple of plain all-reduce's (issue 20, goal 3).
STEPS_GOAL = 1.2


def configs(quick: bool, accelerate: bool) -> list[str]:
    """The ``system:hook`` pairs to run."""
    if quick:
        return list(QUICK)
    return [
        f"{s}:{h}"
        for s in SYSTEMS
        for h in HOOKS
        if f"{s}:{h}" not in UNSUPPORTED and (accelerate or s != "accelerate")
    ]


def groups(pairs: Sequence[str]) -> list[list[str]]:
    """One launch per system, torch's PowerSGD pairs alone."""
    out: list[list[str]] = []
    for system in SYSTEMS:
        shared = [p for p in pairs if p.startswith(system + ":") and p not in ALONE]
        out += [shared] if shared else []
        out += [[p] for p in pairs if p.startswith(system + ":") and p in ALONE]
    return out


def run(
    ns: Any,
    launch: Callable[..., Any],
    rate: str,
    quick: bool,
    out: str | None,
    *,
    width: int = 128,
    accelerate: bool = True,
    timeout: float = 900.0,
    only: Sequence[str] | None = None,
) -> int:
    """Launch the workers in ``ns`` and print the table; the exit status. ``only``: these
    ``system:hook`` pairs instead of every one (``--configs``)."""
    results: dict[str, dict[str, Any]] = {}
    chosen = list(only) if only else configs(quick, accelerate)
    pending = groups(chosen)
    while pending:
        group = pending.pop(0)
        print(f"[time-to-accuracy] {rate}: {','.join(group)}", flush=True)
        args = ["--configs", ",".join(group), "--width", str(width)]
        limit = min(timeout, ALONE_TIMEOUT_S) if group[0] in ALONE else timeout
        data, error = launch(ns, "benchmarks.bandwidth_accuracy", args, limit)
        if data is not None:
            results.update({r["config"]: r for r in data["results"]})
        elif len(group) > 1:
            pending = [[c] for c in group] + pending
        else:
            results[group[0]] = {"config": group[0], "error": error}
    rows = [results[c] for c in chosen if c in results]
    print("\n".join(markdown(rows, rate, width)), flush=True)
    if out:
        with open(out, "w", encoding="utf-8") as handle:
            json.dump({"rate": rate, "width": width, "results": rows}, handle, indent=2)
    return 0 if any(r.get("seconds") for r in rows) else 1


def markdown(rows: Sequence[dict[str, Any]], rate: str, width: int) -> list[str]:
    """The table, and each system's best setting with its steps against plain all-reduce's."""
    lines = [
        f"#### time to {TARGET:.0%} held-out accuracy, digits MLP 64-{width}-{width // 2}-10, "
        f"2 ranks, loopback {rate}",
        "",
        "| system:hook | seconds | steps | steps vs system:no | ms/step | accuracy reached |",
        "|---|---|---|---|---|---|",
    ]
    plain = {r["config"].split(":")[0]: r.get("steps") for r in rows if r["config"].endswith(":no")}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | failed: {r['error']} |||||")
            continue
        seconds = "not reached" if r["seconds"] is None else f"{r['seconds']:.2f}"
        base = plain.get(r["config"].split(":")[0])
        ratio = f"{r['steps'] / base:.2f}x" if base and r["seconds"] is not None else "-"
        lines.append(
            f"| {r['config']} | {seconds} | {r['steps']} | {ratio} | {r['ms_per_step']:.1f} "
            f"| {r['accuracy']:.3f} |"
        )
    lines += ["", "| system | fastest setting to target | seconds | steps within "
              f"{STEPS_GOAL}x of plain |", "|---|---|---|---|"]  # fmt: skip
    for system in SYSTEMS:
        reached = [r for r in rows if r["config"].startswith(system + ":") and r.get("seconds")]
        if not reached:
            continue
        best = min(reached, key=lambda r: r["seconds"])
        base = plain.get(system)
        within = "-" if not base else ("yes" if best["steps"] <= STEPS_GOAL * base else "no")
        lines.append(f"| {system} | {best['config']} | {best['seconds']:.2f} | {within} |")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """Per-rank entry point under torchrun."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", required=True, help="system:hook,...")
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    results = []
    for config in args.configs.split(","):
        system, hook = config.split(":")
        try:
            result = train(system, hook, HOOKS[hook], args.width)
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
        results.append({"config": config, **result})
        dist.barrier()
    if dist.get_rank() == 0:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump({"results": results, "eval_every": EVAL_EVERY}, handle, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

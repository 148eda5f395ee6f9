"""Where a communication hook's time goes on a fast link: 2 ranks, gloo, the host's loopback.

``python -m benchmarks.hook_profile [--configs kwplug:no,kwplug:fp16,...] [--steps 20]``
launches itself under torchrun (no root needed, no rate limit). Rank 0 reports, per
configuration of :mod:`benchmarks.bandwidth_systems` (the 2.1M-parameter MLP, batch 32):

- wall ms/step, and CPU ms/step of the whole process (``time.process_time``: the main thread,
  gloo's threads and the future callbacks that run on them) and of the main thread alone
  (``time.thread_time``);
- the top Python functions of the main thread by own time (``cProfile``) -- the hooks'
  Python work, copies and allocations done inline;
- the top torch operators by self CPU time over all threads (``torch.profiler``), which sees
  the work done in ``Future.then`` callbacks on gloo's threads too.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import bandwidth_systems as systems
from benchmarks._common import child_env

DEFAULT = ",".join(
    f"kwplug:{h}" for h in ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd", "int8", "topk")
)


def _top_python(profile: cProfile.Profile, steps: int, count: int = 12) -> list[str]:
    stream = io.StringIO()
    stats = pstats.Stats(profile, stream=stream)
    rows = []
    for (file, line, name), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{os.path.basename(file)}:{line}({name})" if line else name
        rows.append((tottime, cumtime, calls, where))
    rows.sort(reverse=True)
    return [
        f"{tot / steps * 1e3:7.2f} ms own  {cum / steps * 1e3:7.2f} ms cum  "
        f"{calls / steps:6.1f} calls/step  {where}"
        for tot, cum, calls, where in rows[:count]
    ]


def _top_ops(prof: torch.profiler.profile, steps: int, count: int = 12) -> list[str]:
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return [
        f"{e.self_cpu_time_total / steps / 1e3:7.2f} ms self  {e.count / steps:6.1f} calls/step  "
        f"{e.key}"
        for e in events[:count]
    ]


def profile_config(config: str, data: Sequence[systems.Batch], warmup: int) -> dict[str, Any]:
    """Time and profile one configuration (every rank takes part; rank 0's figures count)."""
    system, hook = config.split(":")
    step = systems.BUILDERS[system](hook)
    step(data[:warmup])
    steps = len(data)
    dist.barrier()
    wall, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
    step(data)
    dist.barrier()
    figures = {
        "wall_ms": (time.perf_counter() - wall) / steps * 1e3,
        "process_cpu_ms": (time.process_time() - cpu) / steps * 1e3,
        "main_thread_cpu_ms": (time.thread_time() - thread) / steps * 1e3,
    }
    profile = cProfile.Profile()
    profile.enable()
    step(data)
    profile.disable()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(data)
    dist.barrier()
    return {**figures, "python": _top_python(profile, steps), "ops": _top_ops(prof, steps)}


def worker(args: argparse.Namespace) -> None:
    """Per rank, under torchrun."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    batches = systems.make_batches(dist.get_rank())
    data = (batches * (args.steps // len(batches) + 1))[: args.steps]
    results = {c: profile_config(c, data, 3) for c in args.configs.split(",")}
    if dist.get_rank() == 0:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)
    dist.barrier()
    dist.destroy_process_group()


def report(results: dict[str, dict[str, Any]]) -> list[str]:
    """The summary table, then each configuration's top functions and operators."""
    base = results.get("kwplug:no", {}).get("wall_ms")
    lines = [
        "| config | wall ms/step | vs kwplug:no | process CPU ms/step | main-thread CPU ms/step |",
        "|---|---|---|---|---|",
    ]
    for config, r in results.items():
        ratio = f"{r['wall_ms'] / base:.2f}x" if base else "—"
        lines.append(
            f"| {config} | {r['wall_ms']:.1f} | {ratio} | {r['process_cpu_ms']:.1f} "
            f"| {r['main_thread_cpu_ms']:.1f} |"
        )
    for config, r in results.items():
        lines += ["", f"#### {config}: Python (main thread)", *r["python"]]
        lines += [f"#### {config}: torch ops (all threads)", *r["ops"]]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Launch the workers (or be one, with ``--out``); print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=DEFAULT)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="(worker) where rank 0 writes")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.out is not None:
        worker(args)
        return 0
    from kwplug.testing import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "profile.json")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m",
            "benchmarks.hook_profile", "--out", out, "--configs", args.configs,
            "--steps", str(args.steps),
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=child_env(), check=False)
        if proc.returncode != 0 or not os.path.exists(out):
            print(f"hook_profile failed (exit {proc.returncode})")
            return 1
        with open(out, encoding="utf-8") as handle:
            results = json.load(handle)
    print("\n".join(report(results)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sharded checkpoints: per-rank memory and time of ``save_state``/``load_state`` of an FSDP2
model and AdamW, against torch's own ``torch.distributed.checkpoint`` with its default storage.

``python -m benchmarks checkpoint --sharded [--size 1G] [--procs 1,2,4] [--dir DIR]
[--json PATH] [--quick]`` (not part of the default run: it writes gigabytes; ``--quick`` is a
16 MiB model at 1 and 2 processes). For each number of processes one torchrun job (gloo, one
thread per rank) builds the same model (``Linear(2048, 2048, bias=False)`` layers, float32,
as many as ``--size`` needs), shards it with the kwplug-fsdp plugin (at 1 process the plugin
declines and the model stays whole), takes one AdamW step so that every state tensor exists
(the state is 3x the parameters), and then, on every rank, one after the other:

- ``kwplug``: ``Accelerator.save_state`` (SHARDED_STATE_DICT: each rank streams its shards
  through DCP) then ``Accelerator.load_state`` of it into the live objects (verified);
- ``torch DCP``: ``torch.distributed.checkpoint.save`` of ``get_state_dict(model,
  optimizer)`` (default ``FileSystemWriter``: ``.distcp`` files and a pickled ``.metadata``)
  then ``load`` and ``set_state_dict``.

Peak extra memory is the rank's peak resident set during the operation minus its resident
set just before (``/proc/self/clear_refs`` resets ``VmHWM``), compared with the rank's shard
(its parameters and optimizer state). Files are read back from the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import write_json
from benchmarks.checkpoint import parse_size

WIDTH = 2048
METHODS = ("kwplug", "torch DCP")
MIB = 1 << 20


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measure(op: Callable[[], None]) -> tuple[float, int]:
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.barrier()
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")  # reset VmHWM to the current resident set
    before = _status("VmRSS")
    start = time.perf_counter()
    op()
    elapsed = time.perf_counter() - start
    return elapsed, max(_status("VmHWM") - before, 0)


def worker(size: int, directory: str, out: str) -> None:
    """One rank: build, measure every method, write this rank's JSON."""
    import torch
    import torch.distributed.checkpoint as dcp
    from kwplug_fsdp import FullyShardedKwargs
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import kwplug

    accelerator = kwplug.Accelerator(
        cpu=True, kwargs_handlers=[FullyShardedKwargs(shard_modules=(nn.Linear,))]
    )
    torch.manual_seed(0)
    layers = max(1, size // (WIDTH * WIDTH * 4))
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.ones(1, WIDTH)).sum())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    shard = sum(local(p).nbytes for p in model.parameters())
    shard += sum(
        local(v).nbytes
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    inner = optimizer.optimizer
    kwplug_dir, dcp_dir = os.path.join(directory, "kwplug"), os.path.join(directory, "dcp")

    def dcp_save() -> None:
        msd, osd = get_state_dict(model, inner)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)

    def dcp_load() -> None:
        msd, osd = get_state_dict(model, inner)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
        set_state_dict(model, inner, model_state_dict=msd, optim_state_dict=osd)

    result: dict[str, Any] = {"rank": accelerator.process_index, "shard_bytes": shard}
    ops = {
        "kwplug": (
            lambda: accelerator.save_state(kwplug_dir),
            lambda: accelerator.load_state(kwplug_dir),
        ),
        "torch DCP": (dcp_save, dcp_load),
    }
    for method, (save, load) in ops.items():
        result[method] = {"save": _measure(save), "load": _measure(load)}
    accelerator.end_training()
    Path(out, f"rank_{result['rank']}.json").write_text(json.dumps(result))


def run_job(
    procs: int, size: int, base: str, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """One torchrun job of ``procs`` ranks (``env``: more environment variables); each
    rank's result."""
    from kwplug.testing.distributed import free_port

    directory, out = os.path.join(base, f"ckpt-{procs}"), os.path.join(base, f"out-{procs}")
    os.makedirs(directory)
    os.makedirs(out)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        "-m", "benchmarks.checkpoint_sharded", "--worker", "--size", str(size),
        "--dir", directory, "--out", out,
    ]  # fmt: skip
    full = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        cmd, check=True, env=full, timeout=1800, cwd=os.path.dirname(os.path.dirname(__file__))
    )
    ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank_*.json"))]
    shutil.rmtree(directory)
    return ranks


def rows(procs: int, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method: the worst rank's time and extra memory, and that memory over its shard."""
    shard = max(r["shard_bytes"] for r in ranks)
    found = []
    for method in METHODS:
        row: dict[str, Any] = {"procs": procs, "method": method, "shard_bytes": shard}
        for op in ("save", "load"):
            row[f"{op}_s"] = max(r[method][op][0] for r in ranks)
            row[f"{op}_extra_bytes"] = max(r[method][op][1] for r in ranks)
            row[f"{op}_extra_over_shard"] = row[f"{op}_extra_bytes"] / shard
        found.append(row)
    return found


def table(found: list[dict[str, Any]], size: int) -> list[str]:
    """The Markdown table of ``found``."""
    lines = [
        f"Sharded checkpoint, {size / MIB:.0f} MiB of fp32 parameters + AdamW (state 3x), "
        "per rank (the worst rank):",
        "",
        "| processes | method | shard / rank (MiB) | save (s) | save extra RSS (MiB, x shard) "
        "| load (s) | load extra RSS (MiB, x shard) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in found:
        lines.append(
            f"| {r['procs']} | {r['method']} | {r['shard_bytes'] / MIB:.0f} | {r['save_s']:.2f} "
            f"| {r['save_extra_bytes'] / MIB:.1f} ({r['save_extra_over_shard']:.3f}x) "
            f"| {r['load_s']:.2f} | {r['load_extra_bytes'] / MIB:.1f} "
            f"({r['load_extra_over_shard']:.3f}x) |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one rank of it); print the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", default="1G", help="parameter bytes, e.g. 128M, 1G")
    parser.add_argument("--procs", default="1,2,4", help="numbers of processes")
    parser.add_argument("--quick", action="store_true", help="16 MiB at 1 and 2 processes")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the rows as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(int(args.size), args.dir, args.out)
        return 0
    if args.quick:
        args.size, args.procs = "16M", "1,2"
    size = parse_size(args.size)
    found: list[dict[str, Any]] = []
    base = tempfile.mkdtemp(prefix="kwplug-sharded-bench-", dir=args.dir)
    try:
        for procs in (int(p) for p in args.procs.split(",")):
            found += rows(procs, run_job(procs, size, base))
            print("\n".join(table(found, size)[-len(METHODS) :]), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("\n".join(table(found, size)))
    write_json({"benchmark": "checkpoint --sharded", "size": size, "rows": found}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

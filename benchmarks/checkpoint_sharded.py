"""Sharded checkpoints: per-rank memory and time of ``save_state``/``load_state`` of an FSDP2
model and AdamW, against torch's own ``torch.distributed.checkpoint`` with its default storage
and Accelerate's ``SHARDED_STATE_DICT``.

``python -m benchmarks checkpoint --sharded [--size 1G] [--procs 1,2,4] [--dir DIR]
[--json PATH] [--quick] [--no-accelerate]`` (not part of the default run: it writes
gigabytes; ``--quick`` is a 16 MiB model at 1 and 2 processes). For each number of processes
a torchrun job (gloo, one thread per rank) builds the same model (``Linear(2048, 2048,
bias=False)`` layers, float32, as many as ``--size`` needs), shards every layer and the root
with FSDP2 (the built-in ``FullyShardedDataParallelPlugin(fsdp_version=2,
state_dict_type="SHARDED_STATE_DICT")``; in one process, where the plugin leaves a model
whole, the job starts a one-process group and calls ``fully_shard`` itself), takes one AdamW
step so that every state tensor exists (the state is 3x the parameters), and then, on every
rank, one after the other:

- ``kwplug``: ``Accelerator.save_state`` (each rank streams its shards through DCP into
  safetensors files) then ``Accelerator.load_state`` of it into the live objects (verified);
- ``torch DCP``: ``torch.distributed.checkpoint.save`` of ``get_state_dict(model,
  optimizer)`` (default ``FileSystemWriter``: ``.distcp`` files and a pickled ``.metadata``)
  then ``load`` and ``set_state_dict``.

A second job per number of processes runs Accelerate 1.16's ``save_state``/``load_state``
with the same plugin fields (``Accelerate``; its FSDP2 path forced onto gloo, as
``tests/parallel/test_fsdp_mesh.py`` does), so that neither library's memory shows in the
other's rows.

Peak extra memory is the rank's peak resident set during the operation minus its resident
set just before (``/proc/self/clear_refs`` resets ``VmHWM``), compared with the rank's shard
(its parameters and optimizer state). Files are read back from the page cache.
"""

from __future__ import annotations

import argparse
import importlib.util
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
METHODS = ("kwplug", "torch DCP", "Accelerate")
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


def _build(size: int, alone: bool) -> tuple[Any, Any]:
    """The benchmark's model (``Linear`` layers, seed 0; ``alone``: sharded by hand, see
    :func:`_alone`) and its AdamW optimizer."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = max(1, size // (WIDTH * WIDTH * 4))
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))
    if alone:
        _shard_alone(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _shard_bytes(model: Any, optimizer: Any) -> int:
    """This rank's bytes of parameters and optimizer state (local shards of DTensors)."""
    import torch

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    found = sum(local(p).nbytes for p in model.parameters())
    return found + sum(
        local(v).nbytes
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def _alone() -> bool:
    """True in a one-process job, after starting its (gloo) process group.

    The plugins (kwplug's and Accelerate's alike) leave a model whole in one process and start
    no process group, so the 1-process row starts one and shards by hand (:func:`_shard_alone`)
    to measure the same sharded path as the other rows.
    """
    import torch.distributed as dist

    if os.environ.get("WORLD_SIZE") != "1":
        return False
    dist.init_process_group("gloo")
    return True


def _shard_alone(model: Any) -> None:
    """``fully_shard`` each layer and the root on a one-process mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _fsdp_plugin(library: Any) -> Any:
    return library.FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Linear"], state_dict_type="SHARDED_STATE_DICT",
    )  # fmt: skip


def _step(accelerator: Any, model: Any, optimizer: Any) -> None:
    """One AdamW step, so that every optimizer state tensor exists."""
    import torch

    accelerator.backward(model(torch.ones(1, WIDTH)).sum())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def worker(size: int, directory: str, out: str) -> None:
    """One rank of kwplug's job: build, measure kwplug then torch's DCP, write this rank's
    JSON."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import kwplug
    import kwplug.utils

    alone = _alone()
    accelerator = kwplug.Accelerator(cpu=True, fsdp_plugin=_fsdp_plugin(kwplug.utils))
    model, optimizer = _build(size, alone)
    model, optimizer = accelerator.prepare(model, optimizer)
    _step(accelerator, model, optimizer)
    inner = optimizer.optimizer
    kwplug_dir, dcp_dir = os.path.join(directory, "kwplug"), os.path.join(directory, "dcp")

    def dcp_save() -> None:
        msd, osd = get_state_dict(model, inner)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)

    def dcp_load() -> None:
        msd, osd = get_state_dict(model, inner)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
        set_state_dict(model, inner, model_state_dict=msd, optim_state_dict=osd)

    rank = accelerator.process_index
    result: dict[str, Any] = {"rank": rank, "shard_bytes": _shard_bytes(model, optimizer)}
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
    Path(out, f"rank_{rank}.json").write_text(json.dumps(result))


def accelerate_worker(size: int, directory: str, out: str) -> None:
    """One rank of Accelerate's job: its ``SHARDED_STATE_DICT`` ``save_state``/``load_state``.

    Accelerate trains an FSDP plugin as plain DDP on CPU; its FSDP2 path runs on gloo once its
    shared state says ``FSDP`` and holds the plugin (as ``tests/parallel/test_fsdp_mesh.py``
    does). It is a separate job so that neither library's memory shows in the other's rows.
    """
    import accelerate
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    _alone()  # its forced FSDP path shards in one process too
    plugin = _fsdp_plugin(accelerate.utils)
    accelerator = accelerate.Accelerator(cpu=True, fsdp_plugin=plugin)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin
    model, optimizer = _build(size, alone=False)
    model, optimizer = accelerator.prepare(model, optimizer)
    _step(accelerator, model, optimizer)
    rank = accelerator.process_index
    result: dict[str, Any] = {"rank": rank, "shard_bytes": _shard_bytes(model, optimizer)}
    target = os.path.join(directory, "accelerate")
    result["Accelerate"] = {
        "save": _measure(lambda: accelerator.save_state(target)),
        "load": _measure(lambda: accelerator.load_state(target)),
    }
    accelerator.end_training()
    Path(out, f"rank_{rank}.json").write_text(json.dumps(result))


def run_job(
    procs: int, size: int, base: str, library: str = "kwplug", env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """One torchrun job of ``procs`` ranks (``library``: ``"kwplug"`` measures kwplug and
    torch's DCP, ``"accelerate"`` Accelerate; ``env``: more environment variables); each
    rank's result."""
    from kwplug.testing.distributed import free_port

    directory = os.path.join(base, f"ckpt-{library}-{procs}")
    out = os.path.join(base, f"out-{library}-{procs}")
    os.makedirs(directory)
    os.makedirs(out)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        "-m", "benchmarks.checkpoint_sharded", "--worker", library, "--size", str(size),
        "--dir", directory, "--out", out,
    ]  # fmt: skip
    full = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        cmd, check=True, env=full, timeout=1800, cwd=os.path.dirname(os.path.dirname(__file__))
    )
    ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank_*.json"))]
    shutil.rmtree(directory)
    return ranks


def run_all(procs: int, size: int, base: str, accelerate: bool) -> list[dict[str, Any]]:
    """kwplug's job and, with ``accelerate``, Accelerate's; the ranks' results merged."""
    ranks = run_job(procs, size, base)
    if accelerate:
        for mine, theirs in zip(ranks, run_job(procs, size, base, "accelerate"), strict=True):
            mine["Accelerate"] = theirs["Accelerate"]
    return ranks


def rows(procs: int, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method: the worst rank's time and extra memory, and that memory over its shard."""
    shard = max(r["shard_bytes"] for r in ranks)
    found = []
    for method in (m for m in METHODS if m in ranks[0]):
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
    parser.add_argument(
        "--no-accelerate", action="store_true", help="leave out Accelerate's SHARDED_STATE_DICT"
    )
    parser.add_argument("--worker", choices=("kwplug", "accelerate"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run = worker if args.worker == "kwplug" else accelerate_worker
        run(int(args.size), args.dir, args.out)
        return 0
    if not args.no_accelerate and importlib.util.find_spec("accelerate") is None:
        parser.error("accelerate is not installed: pip install accelerate, or --no-accelerate")
    if args.quick:
        args.size, args.procs = "16M", "1,2"
    size = parse_size(args.size)
    found: list[dict[str, Any]] = []
    base = tempfile.mkdtemp(prefix="kwplug-sharded-bench-", dir=args.dir)
    try:
        for procs in (int(p) for p in args.procs.split(",")):
            new = rows(procs, run_all(procs, size, base, not args.no_accelerate))
            found += new
            print("\n".join(table(found, size)[-len(new) :]), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("\n".join(table(found, size)))
    write_json({"benchmark": "checkpoint --sharded", "size": size, "rows": found}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

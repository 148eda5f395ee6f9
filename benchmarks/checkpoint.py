"""Checkpoint memory and time: ``save_state``/``load_state`` against safetensors' own functions.

``python -m benchmarks checkpoint [--sizes 64M,1G,4G] [--optimizers sgd,adam] [--ops ...]
[--reserve 2G] [--dir DIR] [--json PATH] [--quick]`` (not part of the default run: it writes
gigabytes; ``--quick`` is one 16 MiB model with SGD, a smoke test of a few seconds). For each
model size and optimizer, every measurement runs in a fresh interpreter (one thread) that
builds the same model (``Linear(2048, 2048, bias=False)`` layers, float32, as many as the
size needs) and optimizer (SGD with momentum: one state tensor per parameter; Adam: two)
after one step, so that every state tensor exists, and then measures one operation:

- ``kwplug save``: ``Accelerator.save_state`` (model, optimizer, RNG and loader state);
- ``safetensors save``: ``safetensors.torch.save_file`` of the model's state dict and of the
  optimizer's state tensors (two files, the same tensors), each then ``fsync``-ed (a
  checkpoint must be on the disk when the save returns; ``save_state`` fsyncs too);
- ``kwplug load``: ``Accelerator.load_state`` of that checkpoint into the live objects
  (verified: sizes, xxh3-128 checksums, shapes);
- ``safetensors load``: ``safetensors.torch.load_file`` of the two files, copied into the
  model (``load_state_dict``) and the optimizer's state tensors (``copy_``): what a load
  must do, since ``load_file`` alone only maps the file.

Peak extra memory is the process's peak resident set during the operation minus its
resident set just before (Linux: the peak is reset through ``/proc/self/clear_refs`` and
read from ``VmHWM``), compared with the largest single state file. Files are read back from
the page cache (written just before): the disk is not measured.

Memory: a measurement that would not fit is skipped, not run into the OOM killer. Before each
one, the memory it needs (the live model and optimizer state, plus the largest state file for
a load) is compared with ``MemAvailable`` less ``--reserve`` (for the rest of the machine);
a skipped operation is a row's ``skipped`` entry with both figures, and a skipped save skips
the load that reads its files. ``--ops`` runs only some operations (a load runs its save
first: it reads that save's files).
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
from collections.abc import Sequence
from typing import Any

from benchmarks._common import child_env, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH = 2048  # a layer: WIDTH * WIDTH float32 = 16 MiB
OPS = ("kwplug save", "safetensors save", "kwplug load", "safetensors load")
#: The save whose files each load reads.
NEEDS = {"kwplug load": "kwplug save", "safetensors load": "safetensors save"}
#: State tensors per parameter: SGD with momentum one, Adam two.
STATE_TENSORS = {"sgd": 1, "adam": 2}
MIB = 1 << 20
GIB = 1 << 30
#: A fresh interpreter with torch and kwplug imported, and what a measurement allocates besides
#: the tensors (generous: an estimate that is too high skips, one too low is an OOM kill).
OVERHEAD = 768 * MIB


def parse_size(text: str) -> int:
    """Bytes in ``64M``/``1G``/``4G`` (binary units)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text[-1:] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _build(size: int, optimizer_name: str) -> tuple[Any, Any, Any]:
    import torch

    import kwplug

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(_layers(size))]
    )
    # One step (per-tensor implementation: the foreach one allocates temporaries the size of
    # the model) with one gradient tensor shared by every layer: building never holds more
    # than the parameters and their state, so that a 4 GiB model with Adam (12 GiB) fits.
    if optimizer_name == "adam":
        optimizer: Any = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=False)
    grad = torch.full((WIDTH, WIDTH), 1e-3)
    for param in model.parameters():
        param.grad = grad
    optimizer.step()  # every state tensor exists: a load replaces them
    del grad
    optimizer.zero_grad(set_to_none=True)
    accelerator = kwplug.Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _layers(size: int) -> int:
    return max(1, size // (WIDTH * WIDTH * 4))


def estimate(size: int, optimizer_name: str, op: str) -> tuple[int, int]:
    """``(bytes needed, largest state file)`` for ``op`` on that model: the parameters and
    their optimizer state, plus (for a load) the largest file's tensors, plus
    :data:`OVERHEAD`."""
    model = _layers(size) * WIDTH * WIDTH * 4
    largest = model * max(1, STATE_TENSORS[optimizer_name])
    live = model * (1 + STATE_TENSORS[optimizer_name])
    return live + (largest if op.endswith("load") else 0) + OVERHEAD, largest


def mem_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, in bytes (what can be allocated without
    swapping or an OOM kill, page cache included)."""
    with open("/proc/meminfo", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _optimizer_tensors(optimizer: Any) -> dict[str, Any]:
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)
    return {
        f"{index}.{name}": value
        for index, state in enumerate(inner.state.values())
        for name, value in state.items()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    }


def child(op: str, size: int, optimizer_name: str, directory: str) -> dict[str, Any]:
    """Build the model, run ``op`` once, return its time and peak extra memory."""
    import gc

    import safetensors.torch

    accelerator, model, optimizer = _build(size, optimizer_name)
    kwplug_dir = os.path.join(directory, "kwplug")
    model_file = os.path.join(directory, "model.safetensors")
    optimizer_file = os.path.join(directory, "optimizer.safetensors")
    gc.collect()
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")  # reset VmHWM to the current resident set
    before = _status("VmRSS")
    start = time.perf_counter()
    if op == "kwplug save":
        accelerator.save_state(kwplug_dir)
    elif op == "safetensors save":
        safetensors.torch.save_file(model.state_dict(), model_file)
        safetensors.torch.save_file(_optimizer_tensors(optimizer), optimizer_file)
        for name in (model_file, optimizer_file):  # durable, as a checkpoint must be
            fd = os.open(name, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    elif op == "kwplug load":
        accelerator.load_state(kwplug_dir)
    else:
        model.load_state_dict(safetensors.torch.load_file(model_file))
        live = _optimizer_tensors(optimizer)
        for name, value in safetensors.torch.load_file(optimizer_file).items():
            live[name].copy_(value)
    elapsed = time.perf_counter() - start
    peak = _status("VmHWM")
    return {"op": op, "seconds": elapsed, "extra_bytes": max(peak - before, 0)}


def _largest_file(directory: str) -> int:
    sizes = [
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(os.path.join(directory, "kwplug"))
        for name in names
    ]
    return max(sizes)


def run_case(
    size: int,
    optimizer_name: str,
    directory: str,
    ops: Sequence[str] = OPS,
    reserve: int = 2 * GIB,
) -> list[dict[str, Any]]:
    """The operations ``ops`` of one (size, optimizer), each in a fresh interpreter, saves
    first; one that would not fit in memory (:func:`estimate` against ``MemAvailable`` less
    ``reserve``) is a ``skipped`` row instead."""
    wanted = {op for op in ops} | {NEEDS[op] for op in ops if op in NEEDS}
    rows: list[dict[str, Any]] = []
    done: set[str] = set()
    for op in (op for op in OPS if op in wanted):
        need, _ = estimate(size, optimizer_name, op)
        available = mem_available() - reserve
        if op in NEEDS and NEEDS[op] not in done:
            rows.append({"op": op, "skipped": f"its files were not written ({NEEDS[op]})"})
            continue
        if need > available:
            rows.append(
                {
                    "op": op,
                    "skipped": f"needs ~{need / GIB:.1f} GiB, {available / GIB:.1f} GiB "
                    f"available (MemAvailable less {reserve / GIB:.1f} GiB reserve)",
                    "need_bytes": need,
                    "available_bytes": available,
                }
            )
            continue
        out = os.path.join(directory, "result.json")
        cmd = [sys.executable, "-m", "benchmarks.checkpoint", "--child", op]
        cmd += ["--sizes", str(size), "--optimizers", optimizer_name, "--dir", directory]
        cmd += ["--json", out]
        proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), check=False, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{op} ({size} bytes, {optimizer_name}) failed: exit {proc.returncode}"
            )
        with open(out, encoding="utf-8") as handle:
            rows.append(json.load(handle))
        done.add(op)
    largest = _largest_file(directory) if "kwplug save" in done else None
    if largest is None:
        largest = estimate(size, optimizer_name, "kwplug save")[1]
    for row in rows:
        row.update(size=size, optimizer=optimizer_name, largest_file=largest)
    return rows


def table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The Markdown table of ``rows`` (one line per size and optimizer)."""
    lines = [
        "| model | optimizer | largest file | save: kwplug / safetensors (s) | save extra RSS: "
        "kwplug / safetensors | load: kwplug / safetensors (s) | load extra RSS: kwplug / "
        "safetensors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    cases: dict[tuple[int, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        cases.setdefault((row["size"], row["optimizer"]), {})[row["op"]] = row
    for (size, name), ops in cases.items():
        largest = next(iter(ops.values()))["largest_file"]

        def pair(
            kind: str, field: str, ops: dict[str, dict[str, Any]] = ops, largest: int = largest
        ) -> str:
            mine, other = ops.get(f"kwplug {kind}", {}), ops.get(f"safetensors {kind}", {})
            ours, theirs = mine.get(field), other.get(field)
            if field == "seconds":
                if ours is None or theirs is None:
                    return f"{_figure(ours, '.2f')} / {_figure(theirs, '.2f')}"
                ratio = ours / theirs if theirs else float("inf")
                return f"{ours:.2f} / {theirs:.2f} ({ratio:.2f}x)"
            text = f"{_figure(ours, '.0f', MIB)} / {_figure(theirs, '.0f', MIB)} MiB"
            return text + (f" ({ours / largest:.2f}x file)" if ours is not None else "")

        lines.append(
            f"| {size // MIB} MiB | {name} | {largest / MIB:.0f} MiB | {pair('save', 'seconds')} "
            f"| {pair('save', 'extra_bytes')} | {pair('load', 'seconds')} "
            f"| {pair('load', 'extra_bytes')} |"
        )
    skipped = [row for row in rows if "skipped" in row]
    if skipped:
        lines.append("")
        lines += [
            f"- not run ({row['size'] // MIB} MiB, {row['optimizer']}): {row['op']}: "
            f"{row['skipped']}"
            for row in skipped
        ]
    return lines


def _figure(value: float | None, spec: str, unit: int = 1) -> str:
    return "not run" if value is None else format(value / unit, spec)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--child``, one measurement); print the table.
    ``--sharded``: the sharded one (:mod:`benchmarks.checkpoint_sharded`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--sharded" in argv:
        from benchmarks import checkpoint_sharded

        return checkpoint_sharded.main([a for a in argv if a != "--sharded"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64M,1G", help="model sizes, e.g. 64M,1G,4G")
    parser.add_argument("--optimizers", default="sgd,adam", help="sgd, adam or both")
    parser.add_argument(
        "--ops",
        default=",".join(OPS),
        help="operations, comma-separated (a load runs its save first): " + ", ".join(OPS),
    )
    parser.add_argument(
        "--reserve",
        default="2G",
        help="memory left to the rest of the machine: an operation that would need more "
        "than MemAvailable less this is skipped (default 2G)",
    )
    parser.add_argument("--quick", action="store_true", help="one 16 MiB model, SGD: a smoke test")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the rows as JSON")
    parser.add_argument("--child", choices=OPS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.optimizers = "16M", "sgd"
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    names = args.optimizers.split(",")
    ops = [op.strip() for op in args.ops.split(",")]
    unknown = [op for op in ops if op not in OPS] + [n for n in names if n not in STATE_TENSORS]
    if unknown:
        parser.error(f"unknown operation or optimizer: {', '.join(unknown)}")
    if args.child is not None:
        write_json(child(args.child, sizes[0], names[0], args.dir), args.json)
        return 0
    rows: list[dict[str, Any]] = []
    base = tempfile.mkdtemp(prefix="kwplug-ckpt-bench-", dir=args.dir)
    try:
        for size in sizes:
            for name in names:
                case = os.path.join(base, f"{size}-{name}")
                os.makedirs(case)
                done = run_case(size, name, case, ops, parse_size(args.reserve))
                shutil.rmtree(case)
                rows += done
                print("\n".join(table(done)[2:]), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("\n".join(table(rows)))
    write_json({"benchmark": "checkpoint", "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

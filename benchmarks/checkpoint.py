"""Checkpoint memory and time: ``save_state``/``load_state`` against safetensors' own functions.

``python -m benchmarks checkpoint [--sizes 64M,1G] [--optimizers sgd,adam] [--dir DIR]
[--json PATH]`` (not part of the default run: it writes gigabytes). For each model size and
optimizer, every measurement runs in a fresh interpreter (one thread) that builds the same
model (``Linear(2048, 2048, bias=False)`` layers, float32, as many as the size needs) and
optimizer (SGD with momentum: one state tensor per parameter; Adam: two) after one step, so
that every state tensor exists, and then measures one operation:

- ``kwplug save``: ``Accelerator.save_state`` (model, optimizer, RNG and loader state);
- ``safetensors save``: ``safetensors.torch.save_file`` of the model's state dict and of the
  optimizer's state tensors (two files, the same tensors);
- ``kwplug load``: ``Accelerator.load_state`` of that checkpoint into the live objects
  (verified: sizes, sha256, shapes);
- ``safetensors load``: ``safetensors.torch.load_file`` of the two files, copied into the
  model (``load_state_dict``) and the optimizer's state tensors (``copy_``): what a load
  must do, since ``load_file`` alone only maps the file.

Peak extra memory is the process's peak resident set during the operation minus its
resident set just before (Linux: the peak is reset through ``/proc/self/clear_refs`` and
read from ``VmHWM``), compared with the largest single state file. Files are read back from
the page cache (written just before): the disk is not measured.
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
MIB = 1 << 20


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
    layers = max(1, size // (WIDTH * WIDTH * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    if optimizer_name == "adam":
        optimizer: Any = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    for param in model.parameters():
        param.grad = torch.full_like(param, 1e-3)
    optimizer.step()  # every state tensor exists: a load replaces them
    optimizer.zero_grad(set_to_none=True)
    accelerator = kwplug.Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


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


def run_case(size: int, optimizer_name: str, directory: str) -> list[dict[str, Any]]:
    """Every operation of one (size, optimizer), each in a fresh interpreter, saves first."""
    rows = []
    for op in OPS:
        out = os.path.join(directory, "result.json")
        cmd = [sys.executable, "-m", "benchmarks.checkpoint", "--child", op]
        cmd += ["--sizes", str(size), "--optimizers", optimizer_name, "--dir", directory]
        cmd += ["--json", out]
        proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), check=False, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{op} ({size} bytes, {optimizer_name}) failed: exit {proc.returncode}"
            )
        with open(out, encoding="utf-8") as handle:
            rows.append(json.load(handle))
    largest = _largest_file(directory)
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
            ours, theirs = ops[f"kwplug {kind}"][field], ops[f"safetensors {kind}"][field]
            if field == "seconds":
                ratio = ours / theirs if theirs else float("inf")
                return f"{ours:.2f} / {theirs:.2f} ({ratio:.2f}x)"
            return f"{ours / MIB:.0f} / {theirs / MIB:.0f} MiB ({ours / largest:.2f}x file)"

        lines.append(
            f"| {size // MIB} MiB | {name} | {largest / MIB:.0f} MiB | {pair('save', 'seconds')} "
            f"| {pair('save', 'extra_bytes')} | {pair('load', 'seconds')} "
            f"| {pair('load', 'extra_bytes')} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--child``, one measurement); print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64M,1G", help="model sizes, e.g. 64M,1G,4G")
    parser.add_argument("--optimizers", default="sgd,adam", help="sgd, adam or both")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the rows as JSON")
    parser.add_argument("--child", choices=OPS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    names = args.optimizers.split(",")
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
                rows += run_case(size, name, case)
                shutil.rmtree(case)
                print("\n".join(table(rows)[-1:]), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("\n".join(table(rows)))
    write_json({"benchmark": "checkpoint", "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

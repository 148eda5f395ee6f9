"""``python -m benchmarks [--quick] [--json PATH]``: every benchmark, then the combined table.

``python -m benchmarks bandwidth [--rate 200mbit] ...`` runs the wire-bound DDP benchmark
(:mod:`benchmarks.bandwidth`, needs root; not part of the default run) and
``python -m benchmarks startup`` the start-up one alone (:mod:`benchmarks.construct_import`);
``python -m benchmarks checkpoint`` the checkpoint memory and time one
(:mod:`benchmarks.checkpoint`, gigabytes written; not part of the default run either);
``python -m benchmarks instructions`` counts the instructions of a training step under
callgrind (:mod:`benchmarks.step_instructions`, needs valgrind; not in the default run).

Each benchmark runs in a fresh interpreter (``python -m benchmarks.<name> --json <tmp>``, one
OpenMP thread), prints its own table as it finishes, and the combined three-way table and the
targets follow. The exit status is non-zero when a benchmark failed (including its checks:
kwplug's parameters equal raw PyTorch's, no pluggy hook call per training step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import BENCHMARKS
from benchmarks._common import (
    CLOCK_ENV,
    CLOCKS,
    Row,
    Target,
    accelerate_available,
    child_env,
    clock_name,
    meta,
    single_thread,
    table_lines,
    target_lines,
    write_json,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_one(name: str, quick: bool, no_accelerate: bool, tmp: str) -> dict[str, Any]:
    """Run ``benchmarks.<name>`` in a child process; its JSON result (or the failure)."""
    path = os.path.join(tmp, f"{name}.json")
    cmd = [sys.executable, "-m", f"benchmarks.{name}", "--json", path]
    cmd += ["--quick"] if quick else []
    cmd += ["--no-accelerate"] if no_accelerate else []
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), check=False)
    elapsed = time.perf_counter() - start
    print(f"\n[{name}: {elapsed:.1f} s, exit {proc.returncode}]\n", flush=True)
    if proc.returncode != 0 or not os.path.exists(path):
        return {"benchmark": name, "error": f"exit status {proc.returncode}", "elapsed_s": elapsed}
    with open(path, encoding="utf-8") as handle:
        result: dict[str, Any] = json.load(handle)
    result["elapsed_s"] = elapsed
    return result


#: ``python -m benchmarks NAME ...`` -> the module whose ``main(argv)`` runs it.
SUBCOMMANDS = {
    "bandwidth": "benchmarks.bandwidth",
    "startup": "benchmarks.construct_import",
    "checkpoint": "benchmarks.checkpoint",
    "instructions": "benchmarks.step_instructions",
}


def write_picture(combined: dict[str, Any], path: str) -> None:
    """The run's PNG (:func:`benchmarks._plot.write_png`); a message instead when matplotlib
    is missing (the JSON and tables are complete without it)."""
    from benchmarks._plot import MissingMatplotlib, write_png

    try:
        print(f"\n[picture: {write_png(combined, path)}]")
    except MissingMatplotlib as exc:
        print(f"\n[no picture: {exc}]")


def main(argv: Sequence[str] | None = None) -> int:
    """Run every benchmark (or one sub-command); print the table; return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        outcome = importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
        return outcome if isinstance(outcome, int) else 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes (< 1 minute)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the combined JSON")
    parser.add_argument(
        "--png",
        metavar="OUT",
        default=None,
        help="write the PNG here (default: next to --json, same name with .png)",
    )
    parser.add_argument(
        "--no-accelerate", action="store_true", help="skip Accelerate even when installed"
    )
    parser.add_argument(
        "--clock",
        choices=CLOCKS,
        default=None,
        help="wall (default), cpu or thread: time with this process's / thread's CPU time, "
        "robust to other load on a shared machine",
    )
    args = parser.parse_args(argv)
    if args.clock is not None:
        os.environ[CLOCK_ENV] = args.clock
    single_thread()
    start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in BENCHMARKS:
            results[name] = run_one(name, args.quick, args.no_accelerate, tmp)
    rows: list[Row] = []
    targets: list[dict[str, Any]] = []
    for name, result in results.items():
        rows += [Row(**row) for row in result.get("rows", [])]
        targets += [{"benchmark": name, **t} for t in result.get("targets", [])]
    failed = [name for name, result in results.items() if "error" in result]
    with_accelerate = accelerate_available() and not args.no_accelerate
    title = "kwplug vs raw PyTorch vs Accelerate" + (" (quick)" if args.quick else "")
    title += f", clock: {clock_name()}"
    print("\n".join(table_lines(rows, title)))
    print()
    plain = [
        Target(**{k: v for k, v in t.items() if k not in ("benchmark", "status")}) for t in targets
    ]
    print("\n".join(target_lines(plain)))
    if failed:
        print(f"\nFAILED: {', '.join(failed)}")
    combined = {
        "quick": args.quick,
        "meta": {**meta(), "accelerate_run": with_accelerate},
        "elapsed_s": time.perf_counter() - start,
        "benchmarks": results,
        "targets": targets,
        "failed": failed,
    }
    if args.json is not None:
        write_json(combined, args.json)
    png = args.png or (None if args.json is None else os.path.splitext(args.json)[0] + ".png")
    if png is not None:
        write_picture(combined, png)
    print(f"\n[all benchmarks: {combined['elapsed_s']:.1f} s]")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Start-up in fresh processes: kwplug with a warm entry-point cache, without it, Accelerate.

Each child imports torch, then the framework, builds a first ``Accelerator(cpu=True)``, then
times repeated constructions (plain, and with the five handlers). Times are the child's CPU
time (``time.process_time``), which other load on a shared machine disturbs less than wall
time; the table shows medians over ``--reps`` rounds (variants interleaved, one warm-up round
dropped, which also fills the cache). ``--before DIR`` adds a variant that imports the
``kwplug`` package found in ``DIR`` (e.g. an older checkout) ahead of the installed one.

Run: ``python -m benchmarks.startup_cache [--reps N] [--before DIR]``. A standalone command,
not part of ``python -m benchmarks`` (whose ``construct_import`` measures the same steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence

HANDLERS = (
    "AutocastKwargs",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "ProfileKwargs",
)

CHILD = f"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
now = time.process_time
t0 = now(); import torch; t1 = now()
module = __import__(sys.argv[1]); t2 = now()
Accelerator = module.Accelerator
Accelerator(cpu=True); t3 = now()
classes = [getattr(module, name) for name in {HANDLERS!r}]
for _ in range(20):
    Accelerator(cpu=True, kwargs_handlers=[c() for c in classes])
n = 300
s = now()
for _ in range(n):
    Accelerator(cpu=True)
t4 = now()
for _ in range(n):
    Accelerator(cpu=True, kwargs_handlers=[c() for c in classes])
t5 = now()
print(json.dumps(dict(imp=t2 - t1, first=t3 - t2, rep=(t4 - s) / n, rep5=(t5 - t4) / n)))
"""


def run(reps: int, before: str | None) -> dict[str, list[dict[str, float]]]:
    """Interleaved fresh-process rounds; per variant, one timing dict per round."""
    base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    cache = tempfile.mkdtemp(prefix="kwplug-startup-cache-")
    variants: dict[str, tuple[str, dict[str, str]]] = {}
    if before is not None:
        variants["kwplug (--before)"] = ("kwplug", {"PYTHONPATH": before})
    variants["kwplug, cache warm"] = ("kwplug", {"KWPLUG_CACHE_DIR": cache})
    variants["kwplug, KWPLUG_NO_CACHE=1"] = ("kwplug", {"KWPLUG_NO_CACHE": "1"})
    variants["accelerate"] = ("accelerate", {})
    results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for round_ in range(reps + 1):
        for name, (module, extra) in variants.items():
            out = subprocess.run(
                [sys.executable, "-c", CHILD, module],
                capture_output=True,
                text=True,
                env={**base, **extra},
                timeout=600,
                check=True,
            )
            if round_:  # round 0 warms bytecode and the cache
                results[name].append(json.loads(out.stdout.splitlines()[-1]))
    return results


def table(results: dict[str, list[dict[str, float]]]) -> list[str]:
    """The medians, one line per variant."""
    lines = [f"{'':28} {'import':>8} {'first':>8} {'imp+first':>10} {'repeated':>9} {'+5 hdl':>8}"]
    for name, rows in results.items():

        def med(key: str, rows: list[dict[str, float]] = rows) -> float:
            return statistics.median(r[key] for r in rows)

        both = statistics.median(r["imp"] + r["first"] for r in rows)
        lines.append(
            f"{name:28} {med('imp') * 1e3:6.1f}ms {med('first') * 1e3:6.1f}ms "
            f"{both * 1e3:8.1f}ms {med('rep') * 1e6:7.0f}us {med('rep5') * 1e6:6.0f}us"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m benchmarks.startup_cache``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="rounds (median; default 5)")
    parser.add_argument("--before", default=None, help="folder with another kwplug package")
    args = parser.parse_args(argv)
    results = run(args.reps, args.before)
    print(f"median of {args.reps} fresh processes, CPU time")
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()

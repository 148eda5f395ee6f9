"""Bytes each hook hands to torch.distributed collectives per step and rank, vs all-reduce.

Trains the scikit-learn digits MLP (64-128-64-10, 17,226 float32 parameters) in 2 CPU
processes (gloo) with each hook and prints one table row per hook::

    python measure_bytes.py                   # launches itself under torchrun, 2 processes
    python -m torch.distributed.run --nproc-per-node 2 measure_bytes.py

Needs scikit-learn (``pip install -e ".[test]"``). The counting is done by
``kwplug_compress.measure`` (wrapped ``torch.distributed`` functions, inside backward only).
"""

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from kwplug_compress.measure import BASELINE, train_and_measure

#: (comm_hook, comm_state_option) rows of the table; the first is the reference.
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    (BASELINE, {}),
    ("fp16", {}),
    ("int8", {}),
    ("int8", {"error_feedback": True}),
    ("topk", {"ratio": 0.1}),
    ("topk", {"ratio": 0.01}),
]


def table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """Markdown table: hook, bytes/step/rank, ratio to the all-reduce reference, losses."""
    reference = results[BASELINE]["bytes_per_step"]
    lines = [
        "| hook | bytes/step/rank | vs all-reduce | loss start -> end |",
        "| --- | ---: | ---: | --- |",
    ]
    for label, row in results.items():
        lines.append(
            f"| {label} | {row['bytes_per_step']:,.0f} | {row['bytes_per_step'] / reference:.4f} "
            f"| {row['loss_start']:.4f} -> {row['loss_end']:.4f} |"
        )
    numel = next(iter(results.values()))["numel"]
    lines.append(f"\n{numel:,} parameters; float32 all-reduce = {4 * numel:,} bytes")
    return "\n".join(lines)


def _launch(argv: Sequence[str]) -> int:
    # Not under torchrun: run this script in 2 processes on a free local port.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        __file__,
        *argv,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, env=env, timeout=600, check=False).returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps per hook")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        return _launch(sys.argv[1:] if argv is None else list(argv))
    results = train_and_measure(CONFIGS, steps=args.steps)
    if os.environ["RANK"] == "0":
        print(table(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""2-process DDP (torchrun, gloo, CPU): steps/s of raw DDP, kwplug and Accelerate, per hook.

Launches :mod:`benchmarks.ddp_worker` with ``torchrun --nproc-per-node 2`` (one thread per
process) and tabulates rank 0's interleaved timings of the 512-512-10 MLP (batch 64 per rank)
with no communication hook and with each of kwplug's hooks (fp16, bf16, power_sgd,
batched_power_sgd; PowerSGD with ``matrix_approximation_rank=1, start_powerSGD_iter=2``), and
the bytes each hook all-reduces per step and rank (measured, see the worker's docstring).

Run: ``python -m benchmarks.ddp_2proc [--quick] [--json PATH]``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from benchmarks._common import Result, Row, Target, child_env, run_main, timing_row
from benchmarks.ddp_worker import CONTROL

DESCRIPTION = "2-process DDP steps/s and all-reduce bytes per hook: raw vs kwplug vs Accelerate."

#: Hooks whose result kwplug must reproduce bit for bit (checked: parameters equal raw DDP's).
EXACT_HOOKS = ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: Messages of a failed rendezvous (e.g. another job took the free port first): worth a retry.
TRANSIENT = ("EADDRINUSE", "Address already in use", "DistNetworkError", "TCPStore")


def launch(
    quick: bool, with_accelerate: bool, timeout: float = 900.0, attempts: int = 3
) -> dict[str, Any]:
    """Run the worker under torchrun; rank 0's JSON result.

    A launch that fails at rendezvous (a port taken between choosing and binding it, on a
    machine running other jobs) is retried on a new port, up to ``attempts`` times.
    """
    failures: list[str] = []
    for _ in range(attempts):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "ddp.json")
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node=2",
                "--master-addr=127.0.0.1",
                f"--master-port={free_port()}",
                "-m",
                "benchmarks.ddp_worker",
                "--out",
                out,
                *(["--quick"] if quick else []),
                *([] if with_accelerate else ["--no-accelerate"]),
            ]
            proc = subprocess.run(
                cmd,
                cwd=ROOT,
                env=child_env(),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            if proc.returncode == 0 and os.path.exists(out):
                with open(out, encoding="utf-8") as handle:
                    return json.load(handle)  # type: ignore[no-any-return]
            failures.append(
                f"DDP worker failed ({proc.returncode}): {' '.join(cmd)}\n"
                f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
            )
            if not any(marker in proc.stderr for marker in TRANSIENT):
                break
    raise RuntimeError("\n\n".join(failures))


def run(quick: bool, with_accelerate: bool) -> Result:
    """Launch the workers and build the table; see the module docstring."""
    data = launch(quick, with_accelerate)
    result = Result("ddp_2proc", quick)
    builtin = data["no_hook_builtin_allreduce"]
    controls: dict[str, dict[str, float | None]] = {}
    for hook, measured in data["hooks"].items():
        samples = {impl: s for impl, s in measured["samples_s_per_step"].items() if s}
        control = samples.pop(CONTROL, None)
        row = timing_row(f"ddp 2proc mlp, hook={hook}", samples, unit="steps/s", rate=True)
        if control and "raw" in samples:
            aa = timing_row("A/A", {"raw": samples["raw"], "kwplug": control}, rate=True)
            controls[hook] = {"extra_us": aa.kwplug_extra, "vs_raw": aa.kwplug_vs_raw}
            row.note = (
                f"A/A control (a second raw DDP vs raw): {aa.kwplug_vs_raw:.3f}x -- this row's "
                "noise floor"
            )
        for impl, error in measured["errors"].items():
            setattr(row, impl, "error")
            row.note = "; ".join(filter(None, [row.note, f"{impl} failed: {error}"]))
        result.rows.append(row)
    for hook, measured in data["hooks"].items():
        counted = measured["allreduce_per_step"]
        row = Row(case=f"all-reduce bytes/step/rank, hook={hook}", unit="bytes")
        for impl in data["impls"]:
            if impl in measured["errors"]:
                setattr(row, impl, "error")
            elif hook == "no":
                setattr(row, impl, builtin["bytes"])
            elif impl in counted:
                setattr(row, impl, counted[impl]["bytes"])
        if hook == "no":
            row.note = (
                "DDP's built-in C++ all-reduce, measured through torch's equivalent Python "
                "allreduce_hook"
            )
        result.rows.append(row)
    for hook in data["hooks"]:
        ratio = next(r for r in result.rows if r.case.endswith(f"hook={hook}")).kwplug_vs_raw
        noise = controls.get(hook, {}).get("vs_raw")
        result.targets.append(
            Target(
                f"2-process DDP hook={hook}: kwplug vs raw DDP", ratio, ">=", 0.98, "x", noise=noise
            )
        )
    result.checks = {
        "params_equal_raw": {h: m["params_equal_raw"] for h, m in data["hooks"].items()},
        "errors": {h: m["errors"] for h, m in data["hooks"].items() if m["errors"]},
        # kwplug runs exactly raw DDP's arithmetic with every hook: PowerSGD on kwplug's
        # canonical buckets sees the layout its state was built in, DDP's own.
        "kwplug_params_equal_raw": all(
            m["params_equal_raw"].get("kwplug", False)
            for h, m in data["hooks"].items()
            if h in EXACT_HOOKS
        ),
        "exact_hooks": [h for h in data["hooks"] if h in EXACT_HOOKS],
    }
    result.info = {
        "worker": {k: v for k, v in data.items() if k != "hooks"},
        "allreduce_per_step": {h: m["allreduce_per_step"] for h, m in data["hooks"].items()},
        "samples_s_per_step": {h: m["samples_s_per_step"] for h, m in data["hooks"].items()},
        "aa_control": controls,
    }
    return result


def main(argv: Sequence[str] | None = None) -> Result:
    """``python -m benchmarks.ddp_2proc``."""
    return run_main("ddp_2proc", DESCRIPTION, run, argv)


if __name__ == "__main__":
    main()

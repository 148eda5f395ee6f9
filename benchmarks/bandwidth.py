"""Wire-bound DDP: 2 ranks over a rate-limited loopback, every system and hook side by side.

``python -m benchmarks bandwidth --rate 200mbit`` (also ``1gbit``, ``100mbit``, ``none``)
creates a network namespace ``kwplug-bw-<pid>``, brings its loopback up, limits it with
``tc qdisc replace dev lo root tbf rate RATE burst 256kb latency 5000ms`` (not for ``none``),
runs :mod:`benchmarks.bandwidth_worker` under ``torchrun --nproc-per-node 2`` inside it, and
deletes the namespace (always). All traffic stays on that namespace's loopback. Creating a
namespace needs root: without it the benchmark says so and exits 0.

Trainings (:mod:`benchmarks.bandwidth_systems`): raw torch DDP, Accelerate and kwplug, each
with hooks no / fp16 / bf16 / power_sgd / batched_power_sgd / int8 / topk / local_sgd, on a
3-layer 1024-wide MLP (2.1M parameters), SGD, batch 32 per rank. They run interleaved in one
torchrun launch; torch's own PowerSGD hooks (raw DDP's and Accelerate's), which can abort the
process on gloo, each run in a launch of their own, and if the shared launch dies every
configuration is rerun alone -- so one failure marks one configuration ``failed``.

Reported per configuration: ms/step (median of the blocks), the payload bytes this rank hands
to collectives per step, the bytes the loopback carried per step (both ranks; counted from
``/proc/net/dev``), the wire floor (wire bytes / rate), the speed-up over raw DDP without a hook,
and the ratio of the step time to max(wire floor, compute floor), the compute floor being the
same model's single-process step.

``--timeline`` instead runs :mod:`benchmarks.hook_timeline` for ``--configs``: each collective
of a step (bytes, start, time to completion), the collectives per step and their payload.

``--time-to-accuracy`` instead trains the digits MLP with kwplug per hook at the given rate
until 95% held-out accuracy (:mod:`benchmarks.bandwidth_accuracy`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from benchmarks._common import accelerate_available, child_env, write_json
from benchmarks.bandwidth_systems import DEVICE_ENV, HOOKS, SYSTEMS, supported

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
#: torch's PowerSGD hooks on gloo can SIGABRT the process: they run in launches of their own.
ISOLATED = frozenset(
    f"{system}:{hook}"
    for system in ("raw", "accelerate")
    for hook in ("power_sgd", "batched_power_sgd")
)
#: Seconds an isolated launch may take (a healthy one needs well under a minute).
ISOLATED_TIMEOUT_S = 150.0
QUICK_CONFIGS = ("raw:no", "kwplug:no", "kwplug:fp16", "kwplug:power_sgd", "kwplug:int8")


def parse_rate(text: str) -> float | None:
    """Bits per second of ``200mbit``/``1gbit``/...; ``None`` for ``none`` (unlimited).

    Raises:
        ValueError: an unknown unit or a non-positive number.
    """
    text = text.strip().lower()
    if text in ("none", "unlimited"):
        return None
    for unit, scale in sorted(UNITS.items(), key=lambda item: -len(item[0])):
        if text.endswith(unit):
            value = float(text[: -len(unit)]) * scale
            if value <= 0:
                break
            return value
    raise ValueError(f"rate must be like 200mbit, 1gbit or none, got {text!r}")


def missing_privileges() -> str | None:
    """Why the namespace cannot be made here (not root, no ``ip``/``tc``), or ``None``."""
    if os.geteuid() != 0:
        return "needs root to create a network namespace (ip netns add)"
    absent = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"needs {' and '.join(absent)} (iproute2)" if absent else None


class Namespace:
    """A network namespace with its loopback up and rate-limited; deleted on exit."""

    def __init__(self, rate: str | None) -> None:
        self.name = f"kwplug-bw-{os.getpid()}"
        self.rate = rate

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def __enter__(self) -> Namespace:
        self._ip("netns", "add", self.name)
        try:
            self._ip("netns", "exec", self.name, "ip", "link", "set", "lo", "up")
            if self.rate is not None:
                tbf = ["root", "tbf", "rate", self.rate, "burst", "256kb", "latency", "5000ms"]
                self._ip("netns", "exec", self.name, "tc", "qdisc", "replace", "dev", "lo", *tbf)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "netns", "delete", self.name], check=False, capture_output=True)

    def command(self, *args: str) -> list[str]:
        """``args`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *args]


#: NCCL between processes of one host uses shared memory or P2P unless told otherwise; these
#: force its TCP socket transport over the (rate-limited) loopback.
NCCL_OVER_LOOPBACK = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "lo",
}


def launch(
    ns: Namespace, module: str, args: Sequence[str], timeout: float, device: str = "cpu"
) -> tuple[dict[str, Any] | None, str]:
    """Run ``module`` under torchrun (2 ranks) in ``ns``; (rank 0's JSON or None, error)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = ns.command(
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            "--master-addr=127.0.0.1", "--master-port=29500",
            "-m", module, "--out", out, *args,
        )  # fmt: skip
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=_env(device), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
        try:
            log, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return None, f"hung: killed after {timeout:.0f} s"
        if proc.returncode == 0 and os.path.exists(out):
            with open(out, encoding="utf-8") as handle:
                return json.load(handle), ""
        abort = "SIGABRT" in log or "Signal 6" in log
        reason = "SIGABRT" if abort else f"exit {proc.returncode}"
        tail = [line for line in log.strip().splitlines() if "Error" in line][-1:]
        return None, f"{reason}: {tail[0][:160]}" if tail else reason


def _env(device: str) -> dict[str, str]:
    extra = {DEVICE_ENV: device, **(NCCL_OVER_LOOPBACK if device == "cuda" else {})}
    return child_env(**extra)


def merge(into: dict[str, Any], part: dict[str, Any]) -> None:
    """Add a launch's per-configuration results to ``into``."""
    for key in ("samples_s", "wire_bytes", "payload_bytes", "errors"):
        into.setdefault(key, {}).update(part[key])
    into.setdefault("compute_floor_s", []).extend(part["compute_floor_s"])
    into["numel"] = part["numel"]


def run_all(
    ns: Namespace,
    configs: Sequence[str],
    worker_args: Sequence[str],
    timeout: float,
    device: str = "cpu",
) -> dict[str, Any]:
    """Shared launch first, isolated ones after; a dead launch is split into single ones."""
    data: dict[str, Any] = {"errors": {}}
    shared = [c for c in configs if c not in ISOLATED]
    groups = [shared] if shared else []
    groups += [[c] for c in configs if c in ISOLATED]
    while groups:
        group = groups.pop(0)
        print(f"[bandwidth] {ns.rate or 'unlimited'}: {','.join(group)}", flush=True)
        args = ["--configs", ",".join(group), *worker_args]
        # a lone torch PowerSGD config that hangs (it does on gloo) costs little time
        limit = min(timeout, ISOLATED_TIMEOUT_S) if group[0] in ISOLATED else timeout
        part, error = launch(ns, "benchmarks.bandwidth_worker", args, limit, device)
        if part is not None:
            merge(data, part)
        elif len(group) > 1:
            print(f"[bandwidth] shared launch failed ({error}); each alone", flush=True)
            groups = [[c] for c in group] + groups
        else:
            data["errors"][group[0]] = error
    return data


def table(
    data: dict[str, Any], configs: Sequence[str], bits_per_s: float | None
) -> list[dict[str, Any]]:
    """One row per configuration (see the module docstring)."""
    compute = statistics.median(data.get("compute_floor_s") or [float("nan")])
    plain = data.get("samples_s", {}).get("raw:no")
    plain_s = statistics.median(plain) if plain else None
    rows = []
    for config in configs:
        row: dict[str, Any] = {"config": config, "error": data["errors"].get(config)}
        samples = data.get("samples_s", {}).get(config)
        if samples and not row["error"]:
            step = statistics.median(samples)
            steps = int(data.get("steps", 1))
            wire = statistics.median(data["wire_bytes"][config]) / steps
            floor = wire * 8 / bits_per_s if bits_per_s else 0.0
            row.update(
                ms_per_step=step * 1e3,
                payload_bytes=data["payload_bytes"].get(config),
                wire_bytes=wire,
                wire_floor_ms=floor * 1e3,
                speedup_vs_raw_no=plain_s / step if plain_s else None,
                ratio_to_floor=step / max(floor, compute),
            )
        rows.append(row)
    return rows


def markdown(rows: Sequence[dict[str, Any]], rate: str, compute_ms: float) -> list[str]:
    """The rows as a Markdown table."""
    lines = [
        f"### bandwidth: 2 ranks, gloo, loopback rate {rate}, compute floor {compute_ms:.1f} ms",
        "",
        "| system:hook | ms/step | payload B/rank/step | wire B/step | wire floor ms "
        "| speed-up vs raw:no | ratio to max(floor, compute) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("error") or "ms_per_step" not in r:
            lines.append(f"| {r['config']} | failed: {r.get('error') or 'no result'} |||||| ")
            continue
        payload = "0 (C++ only)" if r["payload_bytes"] == 0 else f"{r['payload_bytes']:,.0f}"
        speed = r["speedup_vs_raw_no"]
        lines.append(
            f"| {r['config']} | {r['ms_per_step']:.1f} | {payload} | {r['wire_bytes']:,.0f} "
            f"| {r['wire_floor_ms']:.1f} | {'—' if speed is None else f'{speed:.2f}x'} "
            f"| {r['ratio_to_floor']:.2f}x |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks bandwidth``; the exit status (0 also when skipped)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="200mbit", help="200mbit, 1gbit, none, ...")
    parser.add_argument("--quick", action="store_true", help="5 configurations, short blocks")
    parser.add_argument("--steps", type=int, default=None, help="steps per timed block")
    parser.add_argument("--reps", type=int, default=None, help="timed blocks per config")
    parser.add_argument("--configs", default=None, help="system:hook,... (default: all)")
    parser.add_argument("--no-accelerate", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: nccl")
    parser.add_argument("--time-to-accuracy", action="store_true")
    parser.add_argument(
        "--width", type=int, default=128, help="time-to-accuracy: the MLP's hidden width"
    )
    parser.add_argument(
        "--timeline", action="store_true", help="per-collective timeline of --configs (kwplug)"
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per torchrun launch")
    parser.add_argument("--json", metavar="PATH", default=None)
    args = parser.parse_args(argv)
    bits_per_s = parse_rate(args.rate)
    why = missing_privileges()
    if why is not None:
        print(f"bandwidth benchmark SKIPPED: {why}.")
        return 0
    if args.time_to_accuracy:
        from benchmarks import bandwidth_accuracy

        with Namespace(None if bits_per_s is None else args.rate) as ns:
            return bandwidth_accuracy.run(
                ns, launch, args.rate, args.quick, args.json, width=args.width,
                accelerate=accelerate_available() and not args.no_accelerate,
                timeout=args.timeout_s,
                only=args.configs.split(",") if args.configs else None,
            )  # fmt: skip
    if args.timeline:
        return _timeline(args)
    accel = accelerate_available() and not args.no_accelerate
    if args.configs:
        configs = args.configs.split(",")
    elif args.quick:
        configs = list(QUICK_CONFIGS)
    else:
        configs = [
            f"{s}:{h}" for h in HOOKS for s in SYSTEMS
            if supported(s, h) and (accel or s != "accelerate")
        ]  # fmt: skip
    steps = args.steps or (4 if args.quick else 10)
    reps = args.reps or (1 if args.quick else 2)
    warmup = 2 if args.quick else 3
    worker_args = ["--steps", str(steps), "--reps", str(reps), "--warmup", str(warmup)]
    with Namespace(None if bits_per_s is None else args.rate) as ns:
        data = run_all(ns, configs, worker_args, args.timeout_s, args.device)
    data["steps"] = steps
    rows = table(data, configs, bits_per_s)
    compute_ms = statistics.median(data.get("compute_floor_s") or [float("nan")]) * 1e3
    print("\n".join(markdown(rows, args.rate, compute_ms)), flush=True)
    if args.json:
        write_json({"rate": args.rate, "bits_per_s": bits_per_s, "rows": rows, "raw": data},
                   args.json)  # fmt: skip
    return 0 if any("ms_per_step" in r for r in rows) else 1


def _timeline(args: argparse.Namespace) -> int:
    # benchmarks.hook_timeline under torchrun in the namespace: each collective of one step.
    configs = args.configs or "kwplug:power_sgd,kwplug:batched_power_sgd"
    worker_args = ["--configs", configs, "--steps", str(args.steps or 8)]
    rate = None if parse_rate(args.rate) is None else args.rate
    with Namespace(rate) as ns:
        data, error = launch(ns, "benchmarks.hook_timeline", worker_args, args.timeout_s)
    if data is None:
        print(f"timeline failed: {error}")
        return 1
    for config, row in data.items():
        print(
            f"{config} at {args.rate}: {row['median_step_ms']:.1f} ms/step, "
            f"{row['collectives_per_step']:g} collectives, "
            f"{row['payload_bytes_per_step']:,.0f} B/rank/step; medians: first collective at "
            f"{row.get('median_first_start_ms', float('nan')):.1f} ms, last done at "
            f"{row.get('median_last_done_ms', float('nan')):.1f} ms, nothing in flight for "
            f"{row.get('median_idle_ms', float('nan')):.1f} ms between; the middle step:"
        )
        for c in row["example_step"]["collectives"]:
            print(
                f"  {c['op']:10s} {c['bytes']:>9,} B  at {c['at_ms']:6.1f} ms  "
                f"took {c['took_ms']:5.1f} ms"
            )
    if args.json:
        write_json({"rate": args.rate, "timeline": data}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

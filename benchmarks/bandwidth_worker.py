"""Worker of :mod:`benchmarks.bandwidth`, one per rank under torchrun (gloo on CPU, or nccl).

``--configs raw:no,kwplug:fp16,...`` names the trainings (see
:mod:`benchmarks.bandwidth_systems`). Each is built and run for ``--warmup`` steps (a build or
warm-up error marks it failed, on every rank, and the others go on); then blocks of
``--steps`` steps run interleaved -- the order rotating each repetition -- each block started
by a barrier. Per block rank 0 records seconds per step and the bytes the namespace's
loopback carried (both ranks' traffic: the wire). Afterwards each training runs four more
steps (a LocalSGD period; fewer if a block is shorter) under kwplug-compress's collective
counter (payload bytes this rank handed to ``torch.distributed`` collectives; DDP's built-in
C++ all-reduce is not seen and counts 0). The single-process step time of the same model
(the compute floor) is timed first. Rank 0 writes JSON to ``--out``.
``KWPLUG_BENCH_DEVICE=cuda`` runs on the GPUs with nccl.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import bandwidth_systems as systems


def _error(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0][:160]
    return f"{type(exc).__name__}: {first}".rstrip(": ")


def time_block(step: systems.Step, data: Sequence[systems.Batch]) -> tuple[float, int]:
    """(seconds per step, loopback bytes) of ``step(data)``, started together on all ranks."""
    dist.barrier()
    sent = systems.wire_bytes()
    start = time.perf_counter()
    step(data)
    if data[0][0].is_cuda:
        torch.cuda.synchronize()
    dist.barrier()
    elapsed = time.perf_counter() - start
    return elapsed / len(data), systems.wire_bytes() - sent


def run_configs(
    configs: Sequence[str], data: Sequence[systems.Batch], warmup: int, reps: int
) -> dict[str, Any]:
    """Build, warm up, time (interleaved) and count every configuration."""
    steps: dict[str, systems.Step] = {}
    errors: dict[str, str] = {}
    for config in configs:
        system, hook = config.split(":")
        try:
            step = systems.BUILDERS[system](hook)
            step(data[:warmup])
            ok = True
        except Exception as exc:
            errors[config] = _error(exc)
            ok = False
        if systems.agree(ok):
            steps[config] = step
        else:
            errors.setdefault(config, "failed on the other rank")
    samples: dict[str, list[float]] = {c: [] for c in steps}
    wire: dict[str, list[int]] = {c: [] for c in steps}
    names = list(steps)
    for rep in range(reps):
        shift = rep % max(1, len(names))
        for config in names[shift:] + names[:shift]:
            if config in errors:
                continue
            try:
                seconds, sent = time_block(steps[config], data)
            except Exception as exc:  # e.g. a collective timing out
                errors[config] = _error(exc)
                continue
            samples[config].append(seconds)
            wire[config].append(sent)
    payload: dict[str, float] = {}
    for config, step in steps.items():
        if config in errors:
            continue
        counted = data[: systems.LOCAL_SGD_PERIOD]  # a whole averaging period if data allows
        with systems.payload_counter() as counter:
            step(counted)
        payload[config] = counter.bytes / len(counted)
    return {"samples_s": samples, "wire_bytes": wire, "payload_bytes": payload, "errors": errors}


def compute_floor(data: Sequence[systems.Batch], reps: int) -> list[float]:
    """Seconds per step of the model trained in one process (no communication)."""
    step = systems.local_step()
    step(data[:2])
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        step(data)
        if data[0][0].is_cuda:
            torch.cuda.synchronize()
        out.append((time.perf_counter() - start) / len(data))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point under torchrun."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cuda = systems.device().type == "cuda"
    if cuda:
        torch.cuda.set_device(systems.device())
    timeout = datetime.timedelta(seconds=args.timeout_s)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    rank = dist.get_rank()
    batches = systems.make_batches(rank)
    data = (batches * (args.steps // len(batches) + 1))[: args.steps]
    floor = compute_floor(data, max(2, args.reps))
    result = run_configs(args.configs.split(","), data, args.warmup, args.reps)
    if rank == 0:
        numel = sum(p.numel() for p in systems.make_model().parameters())
        out = {"compute_floor_s": floor, "numel": numel, "steps": args.steps, **result}
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(out, handle, indent=2)
    dist.barrier()
    # Collect DDP modules and hook states while the group exists (a PowerSGD state collected
    # later, on a gloo thread, can abort the process).
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

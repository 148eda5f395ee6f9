"""Worker of ``python -m benchmarks bandwidth --timeline``: where a hooked DDP step's time goes.

Under torchrun (2 ranks, gloo, in the rate-limited namespace of :mod:`benchmarks.bandwidth`),
each ``--configs`` training runs ``--steps`` steps (after ``--warmup``), one barrier-started step
at a time, while every ``torch.distributed`` collective a Python hook issues is wrapped: per step
each collective's name, payload bytes, start (ms after the step began) and the time until its
work's future completed (which includes waiting for the other rank); and per configuration the
medians of the first collective's start, the last one's completion and the time between them
with no collective in flight (the hook's or backward's compute that nothing overlapped). DDP's
built-in C++
all-reduce (no hook) is not seen. Rank 0 writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import bandwidth_systems as systems


@contextlib.contextmanager
def traced_collectives(events: list[dict[str, Any]]) -> Iterator[None]:
    """Record every collective started through the ``torch.distributed`` module while inside
    (the functions and payload arguments of kwplug-compress's ``COLLECTIVE_PAYLOAD``)."""
    from kwplug_compress.measure import COLLECTIVE_PAYLOAD

    originals = {name: getattr(dist, name) for name in COLLECTIVE_PAYLOAD if hasattr(dist, name)}
    # Per thread: a hook may issue collectives from several gloo threads at once.
    inside = threading.local()

    def wrap(name: str, function: Any) -> Any:
        position, keyword = COLLECTIVE_PAYLOAD[name]

        @functools.wraps(function)
        def traced(*args: Any, **kwargs: Any) -> Any:
            if getattr(inside, "value", False):  # one collective implemented by another
                return function(*args, **kwargs)
            payload = args[position] if len(args) > position else kwargs.get(keyword)
            nbytes = payload.numel() * payload.element_size() if torch.is_tensor(payload) else 0
            event: dict[str, Any] = {"op": name, "bytes": nbytes}
            events.append(event)
            event["start"] = time.perf_counter()
            inside.value = True
            try:
                work = function(*args, **kwargs)
            finally:
                inside.value = False
            if work is not None and hasattr(work, "get_future"):

                def done(future: Any) -> Any:
                    event["done"] = time.perf_counter()
                    return future.value()

                work.get_future().then(done)
            else:
                event["done"] = time.perf_counter()
            return work

        return traced

    for name, function in originals.items():
        setattr(dist, name, wrap(name, function))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


def _spans(collectives: list[dict[str, Any]]) -> tuple[float, float, float]:
    """(first start, last completion, time with no collective in flight between them), ms.

    The idle time is what the step's collectives did not overlap: compute of the hook or of
    backward that ran while nothing of the hook was on the wire.
    """
    if not collectives:
        return (0.0, 0.0, 0.0)
    intervals = sorted((c["at_ms"], c["at_ms"] + c["took_ms"]) for c in collectives)
    idle = 0.0
    reach = intervals[0][1]
    for begin, finish in intervals[1:]:
        idle += max(0.0, begin - reach)
        reach = max(reach, finish)
    return (intervals[0][0], reach, idle)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point under torchrun."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    batches = systems.make_batches(rank)
    data = (batches * (args.steps // len(batches) + 1))[: args.steps]
    out: dict[str, Any] = {}
    for config in args.configs.split(","):
        system, hook = config.split(":")
        step = systems.BUILDERS[system](hook)
        step(data[: args.warmup])
        per_step = []
        for batch in data:
            events: list[dict[str, Any]] = []
            dist.barrier()
            start = time.perf_counter()
            with traced_collectives(events):
                step([batch])
            end = time.perf_counter()
            per_step.append(
                {
                    "step_s": end - start,
                    "collectives": [
                        {
                            "op": e["op"],
                            "bytes": e["bytes"],
                            "at_ms": (e["start"] - start) * 1e3,
                            "took_ms": (e.get("done", end) - e["start"]) * 1e3,
                        }
                        for e in events
                    ],
                }
            )
        steps = per_step[1:]
        spans = [_spans(s["collectives"]) for s in steps]
        out[config] = {
            "median_step_ms": statistics.median(s["step_s"] for s in steps) * 1e3,
            "median_first_start_ms": statistics.median(span[0] for span in spans),
            "median_last_done_ms": statistics.median(span[1] for span in spans),
            "median_idle_ms": statistics.median(span[2] for span in spans),
            "collectives_per_step": statistics.median(len(s["collectives"]) for s in steps),
            "payload_bytes_per_step": statistics.median(
                sum(c["bytes"] for c in s["collectives"]) for s in steps
            ),
            "example_step": steps[len(steps) // 2],
        }
    if rank == 0:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(out, handle, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""2-process torchrun (gloo): process-group options, collectives, data sharding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torchrun import torchrun

WORKERS = Path(__file__).parents[1] / "workers"


def results(stdout: str) -> list[dict[str, Any]]:
    rows = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    return sorted(rows, key=lambda r: r["rank"])


def test_init_process_group_kwargs_reach_the_process_group() -> None:
    # The trap: gloo + 600 s must keep its 600 s although to_kwargs() drops it.
    for config, timeout in (("gloo_600", 600.0), ("custom_42", 42.0)):
        run = torchrun(WORKERS / "core_dist.py", config, nproc=2, timeout=120)
        for r in results(run.stdout):
            assert r["backend"] == "gloo"
            assert r["timeout_s"] == timeout
            assert r["num_processes"] == 2


def test_core_distributed_behaviour() -> None:
    run = torchrun(WORKERS / "core_dist.py", "default", nproc=2, timeout=120)
    r0, r1 = results(run.stdout)
    for r in (r0, r1):
        # Default handler on CPU: gloo, the handler's resolved timeout (600 s).
        assert (r["backend"], r["timeout_s"], r["world_size"]) == ("gloo", 600.0, 2)
        assert r["gather"] == [0, 0, 1, 10]
        assert r["gather_scalar"] == [1.0, 2.0]
        assert r["sum"] == 3.0 and r["mean"] == 1.5
    assert r0["is_main"] and not r1["is_main"]
    assert run.stdout.count("printed-by-main") == 1
    # Accelerate's sharding: whole batches in turn (5 batches of 2), the last round completed
    # from the start of the epoch; the same shuffle on both ranks, a new order every epoch.
    for epoch in range(2):
        a, b = r0["epochs"][epoch], r1["epochs"][epoch]
        assert len(a) == len(b) == 6
        assert sorted(set(a + b)) == list(range(10))
    assert r0["epochs"][0] != r0["epochs"][1]
    assert (r0["plain"], r1["plain"]) == ([0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 0, 1])

"""Smoke test of the benchmark suite: ``python -m benchmarks --quick`` runs and reports.

Only the structure is checked -- every benchmark present, kwplug's parameters equal to the raw
loop's, no pluggy hook call per training step, bytes measured for every hook. Timings are for
humans (docs/benchmarks.md), never asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import BENCHMARKS  # noqa: E402

IMPLS = ("raw", "kwplug", "accelerate")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench") / "all.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,  # minutes on a loaded 2-core machine
        check=False,
    )
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.timeout(480)
def test_every_benchmark_reports(quick_run: tuple[dict[str, Any], str]) -> None:
    data, stdout = quick_run
    assert data["quick"] is True
    assert data["failed"] == []
    assert set(data["benchmarks"]) == set(BENCHMARKS)
    accelerate = data["meta"]["accelerate_run"]
    for name, result in data["benchmarks"].items():
        assert result["benchmark"] == name
        assert result["rows"], name
        assert result["targets"], name
        for row in result["rows"]:
            assert row["kwplug"] is not None, (name, row)
            if not accelerate:
                assert row["accelerate"] is None, (name, row)
    for case in ("tiny fp32", "tiny bf16", "mlp fp32", "mlp bf16"):
        row = next(
            r for r in data["benchmarks"]["step_overhead"]["rows"] if r["case"].startswith(case)
        )
        assert isinstance(row["raw"], float) and row["raw"] > 0
        assert isinstance(row["kwplug_vs_raw"], float)
        assert isinstance(row["kwplug_extra"], float)
        if accelerate:
            assert isinstance(row["accelerate"], float)
    # the combined table and the targets are printed
    assert "kwplug vs raw PyTorch vs Accelerate" in stdout
    assert "| target |" in stdout


@pytest.mark.timeout(480)
def test_parameters_equal_raw(quick_run: tuple[dict[str, Any], str]) -> None:
    checks = quick_run[0]["benchmarks"]["step_overhead"]["checks"]
    assert checks["kwplug_params_equal_raw"] is True
    assert set(checks["params_equal"]) == {"tiny fp32", "tiny bf16", "mlp fp32", "mlp bf16"}
    assert all(case["kwplug"] for case in checks["params_equal"].values())
    ddp = quick_run[0]["benchmarks"]["ddp_2proc"]["checks"]
    assert ddp["kwplug_params_equal_raw"] is True


@pytest.mark.timeout(480)
def test_no_pluggy_call_per_step(quick_run: tuple[dict[str, Any], str]) -> None:
    dispatch = quick_run[0]["benchmarks"]["dispatch"]
    assert dispatch["checks"]["pluggy_calls_per_step"] == 0
    for monitored in dispatch["checks"]["monitored"]:
        # pluggy's monitoring, kwplug's dispatcher and the implementations themselves
        assert monitored["calls_in_loop"] == {"pluggy": [], "kwplug": [], "impl": []}, monitored
        # the counters do see setup-time calls: prepare() wraps the model through a hook
        assert "wrap_model" in monitored["calls_at_prepare"]["impl"], monitored


@pytest.mark.timeout(480)
def test_ddp_bytes_per_hook(quick_run: tuple[dict[str, Any], str]) -> None:
    ddp = quick_run[0]["benchmarks"]["ddp_2proc"]
    by_case = {row["case"]: row for row in ddp["rows"]}
    sent = {
        hook: by_case[f"all-reduce bytes/step/rank, hook={hook}"]["kwplug"]
        for hook in ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd")
    }
    assert all(isinstance(v, float) and v > 0 for v in sent.values()), sent
    # half precision halves the payload; PowerSGD compresses far below it
    assert sent["fp16"] == sent["bf16"] == sent["no"] / 2
    assert sent["power_sgd"] < sent["fp16"] / 10
    assert sent["batched_power_sgd"] < sent["fp16"] / 10
    for hook in sent:
        row = by_case[f"ddp 2proc mlp, hook={hook}"]
        assert isinstance(row["kwplug"], float) and row["kwplug"] > 0


# -- the wire-bound benchmark (python -m benchmarks bandwidth) ---------------------------------

from benchmarks import bandwidth  # noqa: E402

needs_netns = pytest.mark.skipif(
    bandwidth.missing_privileges() is not None,
    reason=f"bandwidth benchmark: {bandwidth.missing_privileges()}",
)


@pytest.mark.parametrize(
    ("text", "bits"), [("200mbit", 200e6), ("1gbit", 1e9), ("500kbit", 500e3), ("none", None)]
)
def test_rate_parsing(text: str, bits: float | None) -> None:
    assert bandwidth.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["fast", "0mbit", "-1gbit", "200mb"])
def test_bad_rate_is_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="rate must be like"):
        bandwidth.parse_rate(text)


def test_without_privileges_it_says_so_and_exits_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bandwidth, "missing_privileges", lambda: "needs root (test)")
    monkeypatch.setattr(bandwidth, "Namespace", None)  # would fail if it were used
    assert bandwidth.main(["--rate", "200mbit"]) == 0
    assert "SKIPPED: needs root (test)" in capsys.readouterr().out


def test_table_ratios() -> None:
    data = {
        "errors": {"raw:topk": "SIGABRT"},
        "compute_floor_s": [0.010],
        "steps": 10,
        "samples_s": {"raw:no": [0.7, 0.6], "kwplug:fp16": [0.3, 0.35]},
        "wire_bytes": {"raw:no": [168e6, 168e6], "kwplug:fp16": [84e6, 84e6]},
        "payload_bytes": {"raw:no": 0, "kwplug:fp16": 4.2e6},
    }
    rows = bandwidth.table(data, ["raw:no", "kwplug:fp16", "raw:topk"], 200e6)
    plain, fp16, failed = rows
    assert plain["wire_floor_ms"] == pytest.approx(672.0)  # 16.8 MB/step at 25 MB/s
    assert plain["ratio_to_floor"] == pytest.approx(0.65 / 0.672)
    assert fp16["speedup_vs_raw_no"] == pytest.approx(0.65 / 0.325)
    assert fp16["ratio_to_floor"] == pytest.approx(0.325 / 0.336)
    assert failed["error"] == "SIGABRT" and "ms_per_step" not in failed
    text = "\n".join(bandwidth.markdown(rows, "200mbit", 10.0))
    assert "| raw:topk | failed: SIGABRT" in text


@needs_netns
@pytest.mark.timeout(180)
def test_bandwidth_quick_runs_in_a_namespace(tmp_path: Path) -> None:
    out = tmp_path / "bw.json"
    child = subprocess.Popen(
        [sys.executable, "-m", "benchmarks", "bandwidth", "--quick", "--rate", "200mbit",
         "--no-accelerate", "--json", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        stdout, stderr = child.communicate(timeout=170)
    finally:
        child.kill()
    assert child.returncode == 0, stdout[-4000:] + stderr[-4000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(bandwidth.QUICK_CONFIGS)
    assert all("ms_per_step" in r for r in rows.values()), rows
    plain, fp16 = rows["raw:no"], rows["kwplug:fp16"]
    # the loopback carried about the gradients (2.1M float32) once per rank, half with fp16
    assert 0.9 * 2 * 4 * 2.1e6 < plain["wire_bytes"] < 1.3 * 2 * 4 * 2.1e6
    assert 0.4 < fp16["wire_bytes"] / plain["wire_bytes"] < 0.6
    assert fp16["payload_bytes"] == pytest.approx(2 * 2_109_450, rel=0.01)
    assert plain["wire_floor_ms"] > 500  # 16.8 MB at 200 Mbit/s: the rate limit was in force
    # its own namespace (named by its pid) is gone; another run's may exist meanwhile
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"kwplug-bw-{child.pid}" not in listed.split()


def test_the_picture_is_drawn_from_the_combined_json(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks._plot import panels, write_png

    row = {"case": "tiny fp32 step", "unit": "steps/s", "kwplug_extra": 1.5}
    start = {"case": "repeated Accelerator(5 handlers)", "unit": "µs", "kwplug": 150.0}
    combined = {
        "quick": True,
        "meta": {"torch": "x", "loadavg_1_5_15min": [1.0, 1.0, 1.0]},
        "benchmarks": {
            "step_overhead": {"rows": [row]},
            "construct_import": {"rows": [start]},
        },
    }
    assert len(panels(combined)) == 2
    out = write_png(combined, str(tmp_path / "run.png"))
    assert Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- time to accuracy (python -m benchmarks bandwidth --time-to-accuracy) ---------------------

from benchmarks import bandwidth_accuracy  # noqa: E402


def test_time_to_accuracy_launch_groups_isolate_torch_power_sgd() -> None:
    pairs = bandwidth_accuracy.configs(quick=False, accelerate=True)
    assert "accelerate:topk" not in pairs and "kwplug:topk" in pairs and "raw:topk" in pairs
    groups = bandwidth_accuracy.groups(pairs)
    assert sorted(p for g in groups for p in g) == sorted(pairs)  # each pair runs once
    assert ["raw:power_sgd"] in groups and ["accelerate:power_sgd"] in groups
    assert any("kwplug:power_sgd" in g and len(g) > 1 for g in groups)  # kwplug's shares
    assert all(len({p.split(":")[0] for p in g}) == 1 for g in groups)  # one system a launch
    assert "accelerate:no" not in bandwidth_accuracy.configs(quick=False, accelerate=False)


def test_time_to_accuracy_table_compares_steps_with_plain() -> None:
    rows = [
        {"config": "raw:no", "steps": 100, "seconds": 2.0, "accuracy": 0.95, "ms_per_step": 20.0},
        {"config": "kwplug:no", "steps": 100, "seconds": 2.1, "accuracy": 0.96, "ms_per_step": 21},
        {"config": "kwplug:topk", "steps": 130, "seconds": 1.0, "accuracy": 0.95, "ms_per_step": 8},
        {"config": "kwplug:int8", "steps": 3000, "seconds": None, "accuracy": 0.5,
         "ms_per_step": 9.0},
        {"config": "raw:power_sgd", "error": "SIGABRT"},
    ]  # fmt: skip
    text = "\n".join(bandwidth_accuracy.markdown(rows, "100mbit", 128))
    assert "| kwplug:topk | 1.00 | 130 | 1.30x |" in text
    assert "| kwplug:int8 | not reached | 3000 | - |" in text
    assert "| raw:power_sgd | failed: SIGABRT |" in text
    assert "| kwplug | kwplug:topk | 1.00 | no |" in text  # fastest, but 1.3x the steps
    assert "| raw | raw:no | 2.00 | yes |" in text


def test_timeline_records_each_collective(tmp_path: Path) -> None:
    # benchmarks.hook_timeline's wrapper, in a one-rank gloo group: an async all_reduce and an
    # all_gather_single are each recorded once with their payload bytes and a completion time.
    import torch
    import torch.distributed as dist

    from benchmarks.hook_timeline import traced_collectives

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        events: list[dict[str, Any]] = []
        with traced_collectives(events):
            dist.all_reduce(torch.ones(10), async_op=True).wait()
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(torch.empty(6), torch.ones(6))
        dist.all_reduce(torch.ones(3))  # after the block: not recorded
        deadline = time.monotonic() + 10  # a future's callbacks may run just after wait()
        while any("done" not in e for e in events) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(e["op"], e["bytes"]) for e in events] == [
            ("all_reduce", 40),
            (gather.__name__, 24),
        ]
        assert all(e["done"] >= e["start"] for e in events)
    finally:
        dist.destroy_process_group()


def test_checkpoint_benchmark_skips_what_would_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The 4 GiB rows of docs/benchmarks.md: an operation whose memory (live model and state,
    # plus the largest file for a load) exceeds MemAvailable less the reserve is a "not run"
    # entry naming both figures, and a load whose save was skipped is skipped too.
    from benchmarks import checkpoint as bench

    gib = 1 << 30
    need, largest = bench.estimate(4 * gib, "adam", "kwplug load")
    assert largest == 8 * gib and need == 20 * gib + bench.OVERHEAD
    assert bench.estimate(4 * gib, "adam", "kwplug save")[0] == 12 * gib + bench.OVERHEAD
    monkeypatch.setattr(bench, "mem_available", lambda: 3 * gib)
    rows = bench.run_case(4 * gib, "adam", str(tmp_path), ("kwplug load",), reserve=2 * gib)
    assert [row["op"] for row in rows] == ["kwplug save", "kwplug load"]
    assert "needs ~12.8 GiB, 1.0 GiB available" in rows[0]["skipped"]
    assert "not written" in rows[1]["skipped"]
    lines = bench.table(rows)
    assert "| 4096 MiB | adam | 8192 MiB | not run / not run |" in lines[2]
    assert any(line.startswith("- not run (4096 MiB, adam): kwplug save: needs") for line in lines)


def test_checkpoint_benchmark_table_with_a_skipped_load() -> None:
    from benchmarks import checkpoint as bench

    mib = 1 << 20
    common = {"size": 64 * mib, "optimizer": "sgd", "largest_file": 64 * mib}
    rows = [
        {"op": "kwplug save", "seconds": 2.0, "extra_bytes": mib, **common},
        {"op": "safetensors save", "seconds": 1.0, "extra_bytes": 0, **common},
        {"op": "kwplug load", "seconds": 3.0, "extra_bytes": 64 * mib, **common},
        {"op": "safetensors load", "skipped": "needs ~1.0 GiB, 0.5 GiB available", **common},
    ]
    row = bench.table(rows)[2]
    assert "| 2.00 / 1.00 (2.00x) | 1 / 0 MiB (0.02x file) |" in row
    assert "| 3.00 / not run | 64 / not run MiB (1.00x file) |" in row

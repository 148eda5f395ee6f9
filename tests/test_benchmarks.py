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
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
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
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.timeout(300)
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


@pytest.mark.timeout(300)
def test_parameters_equal_raw(quick_run: tuple[dict[str, Any], str]) -> None:
    checks = quick_run[0]["benchmarks"]["step_overhead"]["checks"]
    assert checks["kwplug_params_equal_raw"] is True
    assert set(checks["params_equal"]) == {"tiny fp32", "tiny bf16", "mlp fp32", "mlp bf16"}
    assert all(case["kwplug"] for case in checks["params_equal"].values())
    ddp = quick_run[0]["benchmarks"]["ddp_2proc"]["checks"]
    assert ddp["kwplug_params_equal_raw"] is True


@pytest.mark.timeout(300)
def test_no_pluggy_call_per_step(quick_run: tuple[dict[str, Any], str]) -> None:
    dispatch = quick_run[0]["benchmarks"]["dispatch"]
    assert dispatch["checks"]["pluggy_calls_per_step"] == 0
    for monitored in dispatch["checks"]["monitored"]:
        # pluggy's monitoring, kwplug's dispatcher and the implementations themselves
        assert monitored["calls_in_loop"] == {"pluggy": [], "kwplug": [], "impl": []}, monitored
        # the counters do see setup-time calls: prepare() wraps the model through a hook
        assert "wrap_model" in monitored["calls_at_prepare"]["impl"], monitored


@pytest.mark.timeout(300)
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

"""DistributedDataParallelKwargs and the DDP communication hooks in 2 real processes.

Each worker script runs once per test session under torchrun (gloo, CPU, 2 processes) and
loops over many configs, so the whole module costs two torchrun launches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from torchrun import torchrun

WORKERS = Path(__file__).parents[1] / "workers"
STEPS = 30  # tests/workers/ddp_hooks_worker.py STEPS


def _run_worker(script: str) -> Any:
    # Built-ins only: the expectations below must not depend on what else is installed.
    result = torchrun(
        WORKERS / script, nproc=2, timeout=120, env={"KWPLUG_DISABLE_PLUGIN_AUTOLOAD": "1"}
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("KWPLUG_RESULT ")]
    assert len(lines) == 1, f"no result line\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return json.loads(lines[0].split(" ", 1)[1])


@pytest.fixture(scope="module")
def kwargs_results() -> list[dict[str, Any]]:
    return _run_worker("ddp_kwargs_worker.py")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def hook_results() -> dict[str, Any]:
    return _run_worker("ddp_hooks_worker.py")  # type: ignore[no-any-return]


# -- constructor options ---------------------------------------------------------------------


def test_default_handler_builds_plain_ddp(kwargs_results: list[dict[str, Any]]) -> None:
    for rank_results in kwargs_results:
        default = rank_results["default"]
        assert default["to_kwargs"] == {}
        assert default["backend"] == "gloo"
        assert default["device_ids"] is None  # CPU: no device_ids
        assert default["dim"] == 0
        assert default["broadcast_buffers"] is True
        assert default["bucket_bytes_cap"] == 25 * 1024 * 1024
        assert default["find_unused_parameters"] is False
        assert default["gradient_as_bucket_view"] is False
        assert default["static_graph"] is False
        # broadcast_buffers=True: rank 0's buffer (1.0) reached rank 1 at construction.
        assert default["marker_after_init"] == [1.0, 1.0, 1.0]
        assert default["warnings"] == []  # defaults are not passed, so no deprecation noise


def test_custom_kwargs_reach_ddp(kwargs_results: list[dict[str, Any]]) -> None:
    for rank, rank_results in enumerate(kwargs_results):
        custom = rank_results["custom"]
        assert custom["bucket_bytes_cap"] == 1 * 1024 * 1024
        assert custom["find_unused_parameters"] is True
        assert custom["broadcast_buffers"] is False
        assert custom["gradient_as_bucket_view"] is True
        # broadcast_buffers=False: each rank kept its own buffer.
        assert custom["marker_after_init"] == [float(rank + 1)] * 3
        # find_unused_parameters=True let 3 steps run with a branch that gets no gradient.
        assert custom["unused_grad_is_none"] is True
        # check_reduction=True reached torch (which deprecates it), as did broadcast_buffers.
        assert any("check_reduction" in w for w in custom["warnings"])
        assert any("broadcast_buffers" in w for w in custom["warnings"])


def test_static_graph_and_fractional_bucket(kwargs_results: list[dict[str, Any]]) -> None:
    for rank_results in kwargs_results:
        static = rank_results["static"]
        assert static["static_graph"] is True
        assert static["bucket_bytes_cap"] == 512 * 1024  # bucket_cap_mb=0.5 MiB
        assert static["to_kwargs"] == {"bucket_cap_mb": 0.5, "static_graph": True}


# -- communication hooks ---------------------------------------------------------------------

TRAINED = [
    "baseline",
    "fp16",
    "bf16",
    "power_sgd",
    "batched_power_sgd",
    "fp16_wrapper_default",
    "bf16_wrapper_default",
    "fp16_wrapper_power_sgd",
    "bf16_wrapper_power_sgd",
    "bf16_wrapper_batched_power_sgd",
    "named_custom",
    "plain_callable",
    "object_callable",
    "partial_callable_bf16_wrapper",
]


@pytest.mark.parametrize("config", TRAINED)
def test_hook_trains_and_keeps_ranks_in_sync(hook_results: dict[str, Any], config: str) -> None:
    result = hook_results[config]
    assert result["loss_after"] < 0.1 * result["loss_before"], result
    assert result["grads_equal"], "synced gradients differ between ranks"
    assert result["params_equal"], "parameters differ between ranks"
    assert result["num_hooks"] == (0 if config == "baseline" else 1)


@pytest.mark.parametrize(
    ("config", "logged"),
    [
        ("fp16", "fp16_compress_allreduce_hook"),
        ("bf16", "bf16_compress_allreduce_hook"),
        ("power_sgd", "powerSGD_hook"),
        ("batched_power_sgd", "batched_power_sgd_hook"),
        ("fp16_wrapper_default", "kwplug_fp16_compress_wrapper_hook[mean_allreduce_hook]"),
        ("bf16_wrapper_default", "kwplug_bf16_compress_wrapper_hook[mean_allreduce_hook]"),
        ("fp16_wrapper_power_sgd", "kwplug_fp16_compress_wrapper_hook[powerSGD_hook]"),
        ("bf16_wrapper_power_sgd", "kwplug_bf16_compress_wrapper_hook[powerSGD_hook]"),
        (
            "bf16_wrapper_batched_power_sgd",
            "kwplug_bf16_compress_wrapper_hook[batched_power_sgd_hook]",
        ),
        ("named_custom", "kwplug_comm_hook[counting_hook]"),
        ("plain_callable", "kwplug_comm_hook[plain_hook]"),
        ("object_callable", "kwplug_comm_hook[ObjectHook]"),
        (
            "partial_callable_bf16_wrapper",
            "kwplug_bf16_compress_wrapper_hook[partial(partial_hook)]",
        ),
    ],
)
def test_ddp_registered_the_expected_hook(
    hook_results: dict[str, Any], config: str, logged: str
) -> None:
    assert hook_results[config]["logged_hook"] == logged


@pytest.mark.parametrize(
    ("config", "dtype"),
    [
        ("fp16", "fp16"),
        ("bf16", "bf16"),
        ("fp16_wrapper_default", "fp16"),
        ("bf16_wrapper_default", "bf16"),
        ("fp16_wrapper_power_sgd", "fp16"),
        ("bf16_wrapper_power_sgd", "bf16"),
        ("bf16_wrapper_batched_power_sgd", "bf16"),
        ("partial_callable_bf16_wrapper", "bf16"),
    ],
)
def test_low_precision_really_used(hook_results: dict[str, Any], config: str, dtype: str) -> None:
    # Averaged in float16/bfloat16, every synced gradient is exactly representable there;
    # in float32 (baseline) they are not.
    assert hook_results[config][f"grads_{dtype}"] is True
    assert hook_results["baseline"][f"grads_{dtype}"] is False
    if dtype == "fp16":
        assert hook_results[config]["grads_bf16"] is False  # and fp16 is not bf16


@pytest.mark.parametrize(
    "config",
    [
        "power_sgd",
        "batched_power_sgd",
        "fp16_wrapper_power_sgd",
        "bf16_wrapper_power_sgd",
        "bf16_wrapper_batched_power_sgd",
    ],
)
def test_power_sgd_compressed(hook_results: dict[str, Any], config: str) -> None:
    result = hook_results[config]
    assert result["psgd_rank"] == 1
    assert result["psgd_iter"] == STEPS
    # start_powerSGD_iter=2: every step from the third on was compressed.
    assert 0 < result["psgd_numel_after"] < result["psgd_numel_before"]


def test_power_sgd_gives_rank_one_gradient(hook_results: dict[str, Any]) -> None:
    # Per-tensor PowerSGD with rank 1 replaces the 32x16 weight gradient by P @ Q.T.
    assert hook_results["power_sgd"]["first_weight_grad_rank"] == 1
    assert hook_results["baseline"]["first_weight_grad_rank"] == 16


def test_batched_power_sgd_compresses_the_whole_bucket(hook_results: dict[str, Any]) -> None:
    result = hook_results["batched_power_sgd"]
    # One bucket of 577 gradients -> a 25x25 matrix -> 2 * 25 * rank 1 elements per step.
    compressed_steps = STEPS - 2
    assert result["psgd_numel_after"] == compressed_steps * 2 * 25
    assert result["psgd_numel_before"] == compressed_steps * 577


@pytest.mark.parametrize(
    ("config", "counter"),
    [
        ("named_custom", "named"),
        ("plain_callable", "plain"),
        ("object_callable", "object"),
        ("partial_callable_bf16_wrapper", "partial"),
    ],
)
def test_custom_hooks_called_on_every_rank(
    hook_results: dict[str, Any], config: str, counter: str
) -> None:
    expected = {"named": 0, "plain": 0, "object": 0, "partial": 0, counter: STEPS}
    for rank_calls in hook_results["_calls_per_rank"]:
        assert rank_calls[config] == expected
    assert len(hook_results["_calls_per_rank"]) == hook_results["_world_size"] == 2


def test_named_custom_hook_state_built_from_options(hook_results: dict[str, Any]) -> None:
    result = hook_results["named_custom"]
    assert result["state_tag"] == "hello"  # comm_state_option reached make_state
    assert result["state_calls"] == STEPS


def test_comm_hooks_mapping_under_torchrun(hook_results: dict[str, Any]) -> None:
    assert hook_results["_comm_hooks"] == {
        "counting": "kwplug.register_comm_hook",
        "fp16": "kwplug",
        "bf16": "kwplug",
        "power_sgd": "kwplug",
        "batched_power_sgd": "kwplug",
        "power_sgd_inplace": "kwplug",
    }

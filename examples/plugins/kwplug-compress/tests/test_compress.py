"""kwplug-compress: option checks, hook numerics, error feedback, discovery, 2-process training.

The 2-process parts run through ``kwplug.testing.run_distributed`` (torchrun, gloo, CPU): one
job for the hook numerics and one for training with ``kwplug.Accelerator``, shared by the tests
that read their results.
"""

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kwplug_compress
import pytest
import torch
import torch.distributed as dist
from kwplug_compress import (
    ResidualMemory,
    int8_bytes,
    int8_hook,
    make_int8_state,
    make_topk_state,
    topk_bytes,
    topk_count,
    topk_hook,
)
from kwplug_compress.measure import BASELINE, count_collective_bytes, train_and_measure

import kwplug
from kwplug.testing import PluginSandbox, run_distributed, run_script

NUMEL = 1537  # odd, and not a multiple of the chunk size: the last chunk is short
CHUNK = 256
TRAIN_CONFIGS: list[tuple[str, dict[str, Any]]] = [
    (BASELINE, {}),
    ("int8", {}),
    ("int8", {"error_feedback": True}),
    ("topk", {"ratio": 0.1}),
    ("topk", {"ratio": 0.01}),
]
TRAIN_STEPS = 60


class FakeBucket:
    """Stands in for torch.distributed.GradBucket (Python cannot construct one)."""

    def __init__(self, tensor: torch.Tensor, index: int = 0, shapes: Any = None) -> None:
        self._tensor = tensor
        self._index = index
        self._params = [torch.empty(s) for s in (shapes or [(tensor.numel(),)])]

    def buffer(self) -> torch.Tensor:
        return self._tensor

    def index(self) -> int:
        return self._index

    def parameters(self) -> list[torch.Tensor]:
        return self._params


def rank_gradient(rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rank)
    grad = torch.randn(NUMEL, generator=generator) * (rank + 1)
    grad[CHUNK : 2 * CHUNK] = 0.0  # an all-zero chunk: scale 0 must not divide by zero
    grad[5] = 40.0  # an outlier that dominates its chunk's scale
    return grad


# -- 2-process workers (module level: run_distributed imports them by name) --------------


def numerics_worker(checkpoint_dir: str) -> dict[str, Any]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    grad = rank_gradient(rank)
    out: dict[str, Any] = {"grad": grad}
    with count_collective_bytes() as counter:
        counter.active = True
        int8_state = make_int8_state(None, {"chunk_size": CHUNK})
        out["int8"] = int8_hook(int8_state, FakeBucket(grad.clone())).wait().clone()
        out["int8_bytes"], counter.bytes = counter.bytes, 0
        for ratio in (1.0, 0.05):
            state = make_topk_state(None, {"ratio": ratio})
            out[f"topk{ratio}"] = topk_hook(state, FakeBucket(grad.clone())).wait().clone()
            out[f"topk{ratio}_residual"] = state.memory.residual(0, ((NUMEL,),), grad).clone()
            out[f"topk{ratio}_bytes"], counter.bytes = counter.bytes, 0
        out["calls"] = dict(counter.calls)
        nan_grad = grad.clone()
        nan_grad[7] = float("nan")
        out["int8_nan"] = int8_hook(int8_state, FakeBucket(nan_grad)).wait().clone()
    out["checkpoint"] = checkpoint_round_trip(checkpoint_dir)
    out["bad_option"] = bad_option_error()
    return out


def bad_option_error() -> str:
    # kwplug checks the options when the Accelerator is built (validate_setup, through the
    # hook's check_options): every rank fails the same way, before any collective.
    handler = kwplug.DistributedDataParallelKwargs(
        comm_hook="topk", comm_state_option={"ratio": 2.0}
    )
    try:
        kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])
    except ValueError as error:
        return str(error)
    return "no error"


def checkpoint_round_trip(directory: str) -> tuple[Any, Any]:
    # Accelerator.save_state/load_state through the states' state_dict()/load_state_dict();
    # the states are caught where kwplug builds them, by the plugin's own factory name.
    states: list[Any] = []
    real = kwplug_compress.make_topk_state

    def recording(process_group: Any, options: Any) -> Any:
        states.append(real(process_group, options))
        return states[-1]

    kwplug_compress.make_topk_state = recording
    try:
        for attempt in range(2):
            handler = kwplug.DistributedDataParallelKwargs(
                comm_hook="topk", comm_state_option={"ratio": 0.1}
            )
            accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 1))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            model, optimizer = accelerator.prepare(model, optimizer)
            if attempt == 0:
                torch.manual_seed(dist.get_rank())
                for _ in range(3):
                    accelerator.backward(model(torch.randn(4, 6)).pow(2).sum())
                    optimizer.step()
                    optimizer.zero_grad()
                accelerator.save_state(directory)
            else:
                accelerator.load_state(directory)
    finally:
        kwplug_compress.make_topk_state = real
    return states[0].state_dict(), states[1].state_dict()


def train_worker() -> dict[str, dict[str, Any]]:
    return train_and_measure(TRAIN_CONFIGS, steps=TRAIN_STEPS)


@pytest.fixture(scope="module")
def numerics(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    checkpoint_dir = tmp_path_factory.mktemp("checkpoint")
    # The ranks see kwplug's built-ins and this plugin only, whatever else is installed.
    with PluginSandbox(keep_installed=["kwplug-compress"]):
        return run_distributed(numerics_worker, str(checkpoint_dir), nproc=2, timeout=120.0)


@pytest.fixture(scope="module")
def training() -> list[dict[str, dict[str, Any]]]:
    pytest.importorskip("sklearn")
    with PluginSandbox(keep_installed=["kwplug-compress"]):
        return run_distributed(train_worker, nproc=2, timeout=180.0)


@pytest.fixture
def one_process() -> Iterator[None]:
    """A one-rank gloo group in this process, for the error-feedback arithmetic."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- numerics (2 processes) --------------------------------------------------------------


def test_int8_within_quantisation_error(numerics: list[dict[str, Any]]) -> None:
    grads = [r["grad"] for r in numerics]
    exact = torch.stack(grads).mean(dim=0)
    result = numerics[0]["int8"]
    assert torch.equal(result, numerics[1]["int8"])  # ranks bitwise identical
    chunks = math.ceil(NUMEL / CHUNK)
    # Rounding to the nearest step loses at most scale / 2 per element and rank.
    bound = torch.zeros(NUMEL)
    for grad in grads:
        padded = torch.nn.functional.pad(grad.abs(), (0, chunks * CHUNK - NUMEL))
        scale = padded.view(chunks, CHUNK).amax(dim=1) / 127
        bound += scale.repeat_interleave(CHUNK)[:NUMEL] / 2
    bound /= len(grads)
    error = (result - exact).abs()
    assert bool((error <= bound * (1 + 1e-5) + 1e-7).all()), float((error - bound).max())
    assert error.max() > 0  # it really was quantised
    assert torch.equal(result[CHUNK : 2 * CHUNK], torch.zeros(CHUNK))
    assert result[5] == pytest.approx(exact[5])  # the chunk maximum is exact


def test_int8_keeps_non_finite_visible(numerics: list[dict[str, Any]]) -> None:
    # A GradScaler must still see an overflow: the NaN's chunk decodes to non-finite values.
    result = numerics[0]["int8_nan"]
    assert not bool(torch.isfinite(result[:CHUNK]).any())
    assert bool(torch.isfinite(result[CHUNK:]).all())


def test_topk_ratio_one_is_the_plain_average(numerics: list[dict[str, Any]]) -> None:
    grads = [r["grad"] for r in numerics]
    expected = (grads[0] + grads[1]) / 2
    for rank_out in numerics:
        assert torch.equal(rank_out["topk1.0"], expected)
        assert torch.equal(rank_out["topk1.0_residual"], torch.zeros(NUMEL))


def test_topk_sends_each_ranks_largest_entries(numerics: list[dict[str, Any]]) -> None:
    k = topk_count(NUMEL, 0.05)
    expected = torch.zeros(NUMEL)
    for rank_out in numerics:
        grad = rank_out["grad"]
        sent = torch.zeros(NUMEL)
        top = grad.abs().topk(k).indices
        sent[top] = grad[top]
        expected += sent / 2
        # What this rank did not send stays in its residual.
        assert torch.equal(rank_out["topk0.05_residual"], grad - sent)
    assert torch.allclose(numerics[0]["topk0.05"], expected, rtol=0, atol=1e-6)
    assert torch.equal(numerics[0]["topk0.05"], numerics[1]["topk0.05"])


def test_bytes_sent_match_the_encoding(numerics: list[dict[str, Any]]) -> None:
    for rank_out in numerics:
        assert rank_out["int8_bytes"] == int8_bytes(NUMEL, CHUNK) == NUMEL + 4 * 7
        assert rank_out["topk1.0_bytes"] == topk_bytes(NUMEL, 1.0) == 8 * NUMEL
        assert rank_out["topk0.05_bytes"] == 8 * math.ceil(0.05 * NUMEL)
        # One all-gather per hook call, nothing else.
        gather = (
            "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        )
        assert rank_out["calls"] == {gather: 3}


# -- error feedback (one process) --------------------------------------------------------


@pytest.mark.usefixtures("one_process")
@pytest.mark.parametrize(
    ("hook", "make_state", "options"),
    [
        (topk_hook, make_topk_state, {"ratio": 0.1}),
        (int8_hook, make_int8_state, {"chunk_size": 64, "error_feedback": True}),
    ],
)
def test_error_feedback_carries_what_was_not_sent(hook: Any, make_state: Any, options: Any) -> None:
    state = make_state(None, options)
    generator = torch.Generator().manual_seed(0)
    sent_total, grad_total = torch.zeros(NUMEL), torch.zeros(NUMEL)
    for _ in range(6):
        grad = torch.randn(NUMEL, generator=generator)
        grad_total += grad
        sent_total += hook(state, FakeBucket(grad.clone())).wait()  # world size 1: what was sent
    residual = state.memory.residual(0, ((NUMEL,),), grad_total)
    assert residual.abs().max() > 0
    torch.testing.assert_close(sent_total + residual, grad_total, rtol=0, atol=1e-5)


@pytest.mark.usefixtures("one_process")
def test_residual_reset_on_new_layout_and_checkpointed() -> None:
    state = make_topk_state(None, {"ratio": 0.1})
    topk_hook(state, FakeBucket(torch.randn(12), shapes=[(3, 4)]))
    residual = state.memory.residual(0, ((3, 4),), torch.empty(12)).clone()
    assert residual.abs().max() > 0
    saved = state.state_dict()
    # DDP rebuilt the bucket with other parameters: the old residual means nothing there.
    topk_hook(state, FakeBucket(torch.zeros(12), shapes=[(4,), (8,)]))
    assert state.memory.residual(0, ((4,), (8,)), torch.empty(12)).abs().max() == 0
    # A restored residual waits for its own layout (a resumed run starts in DDP's first one).
    fresh = make_topk_state(None, {"ratio": 0.1})
    fresh.load_state_dict(saved)
    assert fresh.memory.residual(0, ((12,),), torch.empty(12)).abs().max() == 0
    assert torch.equal(fresh.memory.residual(0, ((3, 4),), torch.empty(12)), residual)
    assert torch.equal(fresh.state_dict()["residuals"][0]["residual"], residual)


def test_accelerator_checkpoints_the_residuals(numerics: list[dict[str, Any]]) -> None:
    for rank_out in numerics:
        saved, loaded = rank_out["checkpoint"]
        residual = saved["residuals"][0]["residual"]
        assert residual.abs().max() > 0  # 3 steps of 10 % top-k left something unsent
        assert loaded["residuals"][0]["layout"] == saved["residuals"][0]["layout"]
        assert torch.equal(loaded["residuals"][0]["residual"], residual)
    # Each rank keeps its own residual.
    assert not torch.equal(
        numerics[0]["checkpoint"][0]["residuals"][0]["residual"],
        numerics[1]["checkpoint"][0]["residuals"][0]["residual"],
    )


def test_residual_memory_round_trip_is_picklable() -> None:
    memory = ResidualMemory()
    memory.residual(3, ((2,),), torch.empty(2)).fill_(1.5)
    restored = ResidualMemory()
    restored.load_state_dict(memory.state_dict())
    assert torch.equal(restored.residual(3, ((2,),), torch.empty(2)), torch.full((2,), 1.5))


# -- options -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "options", "error", "match"),
    [
        ("topk", {"ratio": 0.0}, ValueError, r"'ratio'.*\(0, 1\].*0\.0"),
        ("topk", {"ratio": 1.5}, ValueError, r"'ratio'.*\(0, 1\]"),
        ("topk", {"ratio": float("nan")}, ValueError, r"'ratio'.*\(0, 1\]"),
        ("topk", {"ratio": "0.1"}, TypeError, r"'ratio'.*float in \(0, 1\].*'0.1'"),
        ("topk", {"ratio": True}, TypeError, r"'ratio'"),
        ("topk", {"ratoi": 0.1}, ValueError, r"unknown option.*'ratoi'.*accepted: ratio"),
        ("topk", {"error_feedback": 1}, TypeError, r"'error_feedback'.*True or False"),
        ("int8", {"chunk_size": 0}, ValueError, r"'chunk_size'.*>= 1"),
        ("int8", {"chunk_size": 2.0}, TypeError, r"'chunk_size'.*int"),
        ("int8", {"ratio": 0.1}, ValueError, r"unknown option.*'ratio'.*chunk_size"),
    ],
)
def test_bad_options_are_named(name: str, options: Any, error: type, match: str) -> None:
    record = kwplug.Accelerator(cpu=True).comm_hooks[name]
    with pytest.raises(error, match=match):
        record.build_state(None, options)


def test_bad_option_fails_in_accelerator_under_torchrun(numerics: list[dict[str, Any]]) -> None:
    for rank_out in numerics:
        assert "comm_state_option['ratio'] of the 'topk' hook" in rank_out["bad_option"]


def test_options_and_defaults() -> None:
    comm_hooks = kwplug.Accelerator(cpu=True).comm_hooks
    topk = comm_hooks["topk"].build_state(None, {})
    assert (topk.ratio, topk.error_feedback, topk.process_group) == (0.01, True, None)
    assert comm_hooks["topk"].build_state(None, {"ratio": 1}).ratio == 1.0
    int8 = comm_hooks["int8"].build_state(None, {"chunk_size": 64, "error_feedback": True})
    assert (int8.chunk_size, int8.error_feedback) == (64, True)
    assert "'compress' (kwplug-compress 0.1.0)" in comm_hooks["int8"].source


# -- discovery ---------------------------------------------------------------------------


def kwplug_cli(*args: str, **env: str) -> Any:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KWPLUG_")}
    run = subprocess.run(
        [sys.executable, "-m", "kwplug", *args],
        capture_output=True,
        text=True,
        env={**full_env, **env},
        timeout=60,
        check=True,
    )
    return json.loads(run.stdout)


def test_listed_by_kwplug_plugins() -> None:
    records = {r["name"]: r for r in kwplug_cli("plugins", "--json")}
    compress = records["compress"]
    assert compress["distribution"] == "kwplug-compress"
    assert compress["version"] == "0.1.0"
    assert compress["hooks"] == ["comm_hooks"]
    assert compress["source"] == "third-party"
    assert compress["status"] == "loaded"
    assert compress["class"] == "kwplug_compress"


def test_blocking_removes_the_hook_names(monkeypatch: pytest.MonkeyPatch) -> None:
    assert {"int8", "topk"} <= set(kwplug.Accelerator(cpu=True).comm_hooks)
    monkeypatch.setenv("KWPLUG_BLOCK_PLUGINS", "compress")
    records = {r.name: r for r in kwplug.discover()}
    assert records["compress"].status == "blocked"  # what `kwplug plugins` shows then
    assert not {"int8", "topk"} & set(kwplug.Accelerator(cpu=True).comm_hooks)
    handler = kwplug.DistributedDataParallelKwargs(comm_hook="topk")
    with pytest.raises(
        ValueError,
        match=r"unknown communication hook 'topk'.*not loaded.*'compress' \(kwplug-compress "
        r"0\.1\.0\): blocked",
    ):
        kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])


@pytest.mark.parametrize(
    ("hook", "options", "message"),
    [
        ("topk", {"ratio": 1.5}, r"comm_state_option\['ratio'\] of the 'topk' hook"),
        ("topk", {"ratoi": 0.1}, r"unknown option\(s\) 'ratoi'"),
        ("int8", {"chunk_size": 0}, r"comm_state_option\['chunk_size'\]"),
    ],
)
def test_bad_option_fails_in_a_single_process_too(
    hook: str, options: dict[str, Any], message: str
) -> None:
    handler = kwplug.DistributedDataParallelKwargs(comm_hook=hook, comm_state_option=options)
    with pytest.raises(ValueError, match=message):
        kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])
    good = kwplug.DistributedDataParallelKwargs(comm_hook=hook)
    model = torch.nn.Linear(2, 1)
    assert kwplug.Accelerator(cpu=True, kwargs_handlers=[good]).prepare(model) is model


def test_sandbox_sees_only_kept_distributions(kwplug_plugins: Any) -> None:
    assert "topk" not in kwplug_plugins.accelerator(cpu=True).comm_hooks
    kwplug_plugins.keep_installed("kwplug-compress")
    assert "topk" in kwplug_plugins.accelerator(cpu=True).comm_hooks


# -- training with kwplug.Accelerator (2 processes) ----------------------------------------


def test_training_converges_and_ranks_agree(training: list[dict[str, dict[str, Any]]]) -> None:
    for label, result in training[0].items():
        assert result["loss_end"] < 0.8 * result["loss_start"], (label, result["loss_end"])
        assert result["params"] == training[1][label]["params"], label
    # Error feedback keeps 1 % top-k training going; the hooks ran (one bucket, one call a step).
    assert training[0]["topk:ratio=0.01"]["loss_end"] < 2.0
    for label in ("int8", "topk:ratio=0.1"):
        assert sum(training[0][label]["calls_per_step"].values()) == 1.0


def test_bytes_per_step_against_all_reduce(training: list[dict[str, dict[str, Any]]]) -> None:
    for rank_results in training:
        numel = rank_results[BASELINE]["numel"]
        reference = rank_results[BASELINE]["bytes_per_step"]
        assert reference == 4 * numel  # the measured float32 all-reduce
        int8 = rank_results["int8"]["bytes_per_step"] / reference
        assert int8 == int8_bytes(numel, 512) / (4 * numel)
        # one int8 per element plus one float32 scale per 512 (rounded up to whole chunks)
        assert 0.25 < int8 < 0.25 * (1 + 4 / 512) + 1 / numel
        for ratio in (0.1, 0.01):
            measured = rank_results[f"topk:ratio={ratio}"]["bytes_per_step"] / reference
            assert measured == topk_bytes(numel, ratio) / (4 * numel)
            # k float32 values + k int32 indices = 2 * ratio of the float32 bucket
            assert abs(measured - 2 * ratio) <= 2 / numel


REPO = Path(__file__).resolve().parents[4]


@pytest.mark.parametrize(
    "args",
    [["--config", str(REPO / "examples" / "compress.toml")], ["--comm-hook", "int8"]],
    ids=["topk-config", "int8-flag"],
)
def test_digits_example_trains_with_the_hooks(
    kwplug_plugins: PluginSandbox, args: list[str]
) -> None:
    """examples/train_digits.py selects the hooks by name: no import of kwplug_compress."""
    pytest.importorskip("sklearn")
    kwplug_plugins.keep_installed("kwplug-compress")
    output = run_script(REPO / "examples" / "train_digits.py", *args, "--cpu", "--no-progress")
    found = dict(re.findall(r"(?m)^(\w+)=(\S+)$", output))
    assert found["ranks_identical"] == "True", output
    assert float(found["final_accuracy"]) >= 0.94, output

"""The ``"topk"`` hook's per-rank residuals through kwplug's checkpoints: a bitwise resume at
the same number of processes, and a resize from 2 to 1 and from 1 to 2 processes by the
plugin's own ``resize`` rule (nothing in kwplug's core names this hook)."""

import copy
import warnings
from pathlib import Path
from typing import Any

import kwplug_compress
import pytest
import torch
import torch.distributed as dist

import kwplug
from kwplug.attached_state import attached_states
from kwplug.errors import KwplugWarning
from kwplug.plugins.ddp_comm_hooks import checkpointed_state
from kwplug.testing import PluginSandbox, resize_hook_state, run_distributed

OPTIONS = {"ratio": 0.1}
STEPS, SAVE_AT = 6, 3
#: The bitwise resume runs: hook, options, DDP's bucket_cap_mb. 25 MiB: one bucket, whose
#: parameters DDP reverses when it rebuilds it; 1e-5 MiB (10 bytes): after the rebuild,
#: three buckets ([b2, W2], [b1], [W1]), while a new DDP's first step has all four in one.
RESUMES = {
    "topk": ("topk", OPTIONS, 25.0),
    "topk-small-buckets": ("topk", OPTIONS, 1e-5),
    "int8-small-buckets": ("int8", {"chunk_size": 4, "error_feedback": True}, 1e-5),
    "int8-no-residuals": ("int8", {"chunk_size": 4}, 1e-5),
}


def _train(
    directory: str, resume: bool, hook: str = "topk", options: Any = OPTIONS, cap: float = 25.0
) -> tuple[list[float], Any]:
    # STEPS steps of training with the hook (saving after SAVE_AT), or the resumed run's last
    # steps in a new Accelerator (a new DDP: its first step uses DDP's initial buckets).
    handler = kwplug.DistributedDataParallelKwargs(
        comm_hook=hook, comm_state_option=options, bucket_cap_mb=cap
    )
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    (state,) = attached_states(model)
    saved: Any = None
    if resume:
        accelerator.load_state(directory)
        saved = copy.deepcopy(state.state_dict())  # what was restored
    for step in range(SAVE_AT if resume else 0, STEPS):
        generator = torch.Generator().manual_seed(100 * dist.get_rank() + step)
        accelerator.backward(model(torch.randn(4, 6, generator=generator)).pow(2).sum())
        optimizer.step()
        optimizer.zero_grad()
        if not resume and step + 1 == SAVE_AT:
            accelerator.save_state(directory)
            saved = copy.deepcopy(state.state_dict())  # CPU tensors: not copies
    plain = accelerator.unwrap_model(model)
    return [p.detach().clone() for p in plain.parameters()], saved


def resume_worker(directory: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for label, (hook, options, cap) in RESUMES.items():
        folder = str(Path(directory) / label)
        full, saved = _train(folder, False, hook, options, cap)
        resumed, restored = _train(folder, True, hook, options, cap)
        results[label] = {"full": full, "resumed": resumed, "saved": saved, "restored": restored}
    return results


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("topk_checkpoint")
    with PluginSandbox(keep_installed=["kwplug-compress"]):
        return run_distributed(resume_worker, str(directory), nproc=2, timeout=180.0)


@pytest.fixture(scope="module")
def runs(all_runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rank["topk"] for rank in all_runs]


@pytest.mark.parametrize("label", list(RESUMES))
def test_same_size_resume_is_bitwise_the_uninterrupted_run(
    all_runs: list[dict[str, Any]], label: str
) -> None:
    # Saved after 3 steps, resumed in new processes: the final weights are the uninterrupted
    # run's, bit for bit, on every rank (the first resumed step runs the hook on the saved
    # run's buckets, each with its restored residual).
    for rank in all_runs:
        run = rank[label]
        assert len(run["full"]) == len(run["resumed"]) == 4
        for full, resumed in zip(run["full"], run["resumed"], strict=True):
            assert torch.equal(full, resumed), label
        buckets = 1 if label == "topk" else 3  # DDP's rebuilt buckets
        assert len(run["saved"]["buckets"]) == buckets
        saved = run["saved"]["residuals"]
        if label != "int8-no-residuals":
            assert len(saved) == buckets
            assert any(entry["residual"].abs().max() > 0 for entry in saved.values())
    assert torch.equal(all_runs[0][label]["full"][0], all_runs[1][label]["full"][0])


def test_same_size_resume_restores_the_residuals_bitwise(runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        (key,) = rank["saved"]["residuals"]
        saved, restored = rank["saved"]["residuals"][key], rank["restored"]["residuals"][key]
        assert saved["residual"].abs().max() > 0  # something was left unsent
        assert restored["layout"] == saved["layout"]
        assert torch.equal(restored["residual"], saved["residual"])
    assert not torch.equal(  # each rank saved its own residuals
        runs[0]["saved"]["residuals"][key]["residual"],
        runs[1]["saved"]["residuals"][key]["residual"],
    )


@pytest.mark.parametrize("sizes", [(2, 1), (1, 2)])
def test_resize_follows_the_plugins_rule(
    runs: list[dict[str, Any]], sizes: tuple[int, int]
) -> None:
    record = kwplug_compress.comm_hooks()["topk"]
    assert record.resize is kwplug_compress.resize_residuals
    saving = checkpointed_state(record, kwplug_compress.make_topk_state(None, OPTIONS))
    saving.load_state_dict(runs[0]["saved"])  # what rank 0 wrote into its rank file
    live = checkpointed_state(record, kwplug_compress.make_topk_state(None, OPTIONS))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resize_hook_state(live, saving, old_world_size=sizes[0], new_world_size=sizes[1])
    (warning,) = [str(w.message) for w in caught if issubclass(w.category, KwplugWarning)]
    assert f"model 0: TopKState ({kwplug_compress.RESIZE_NOTE})" in warning
    restored = live.state.state_dict()["residuals"]
    expected = runs[0]["saved"]["residuals"]
    assert restored.keys() == expected.keys()
    for index, entry in expected.items():
        assert restored[index]["layout"] == entry["layout"]
        assert torch.equal(restored[index]["residual"], entry["residual"])


def test_without_the_rule_the_residuals_start_afresh(runs: list[dict[str, Any]]) -> None:
    import attrs

    record = attrs.evolve(kwplug_compress.comm_hooks()["topk"], resize=None)
    saving = checkpointed_state(record, kwplug_compress.make_topk_state(None, OPTIONS))
    saving.load_state_dict(runs[0]["saved"])
    fresh = kwplug_compress.make_topk_state(None, OPTIONS)
    live = checkpointed_state(record, fresh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resize_hook_state(live, saving, old_world_size=2, new_world_size=1)
    assert any("model 0: TopKState (reset)" in str(w.message) for w in caught)
    assert fresh.state_dict()["residuals"] == {}


def test_kwplug_core_does_not_name_the_hook() -> None:
    core = Path(kwplug.__file__).parent
    for path in core.rglob("*.py"):
        if path.is_relative_to(core / "plugins"):
            continue
        text = path.read_text(encoding="utf-8").lower()
        assert "topk" not in text and "kwplug_compress" not in text, path


def test_the_first_bucket_is_cut_into_the_saved_ones_once() -> None:
    # The saving run had rebuilt DDP's single bucket [W1, b1, W2, b2] into [b2, W2], [b1], [W1].
    params = [torch.empty(5, 6), torch.empty(5), torch.empty(1, 5), torch.empty(1)]
    saving = kwplug_compress.ResidualMemory()
    saving.members(0, params)  # DDP's first step names the parameters
    for index, group in enumerate([[params[3], params[2]], [params[1]], [params[0]]]):
        saving.members(index, group)
        saving.residual(index, tuple(tuple(p.shape) for p in group), torch.empty(1)).fill_(index)
    saved = saving.state_dict()
    assert saved["buckets"] == {0: [[0, 3], [0, 2]], 1: [[0, 1]], 2: [[0, 0]]}

    resumed = kwplug_compress.ResidualMemory()
    resumed.load_state_dict(copy.deepcopy(saved))
    members = resumed.members(0, params)  # a new DDP: all four in one bucket again
    assert resumed.tiles(0, members) == [(0, (3, 2)), (1, (1,)), (2, (0,))]
    assert resumed.tiles(0, members) is None  # only on DDP's first buckets
    layout = ((1,), (1, 5))
    restored = resumed.residual(0, layout, torch.empty(6), resumed.members(0, params[3:1:-1]))
    assert torch.equal(restored, saved["residuals"][0]["residual"])


def test_a_checkpoint_without_buckets_restores_by_layout() -> None:
    # Written before the buckets were saved: no cutting, each residual waits for its layout.
    residual = torch.arange(4.0)
    memory = kwplug_compress.ResidualMemory()
    memory.load_state_dict({"residuals": {0: {"layout": [[4]], "residual": residual}}})
    members = memory.members(0, [torch.empty(4)])
    assert memory.tiles(0, members) is None
    assert torch.equal(memory.residual(0, ((4,),), residual, members), residual)

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
from kwplug.checkpoint import attached_states
from kwplug.checkpoint._resize import load_resized_hooks
from kwplug.checkpoint._stateful import hook_state_dict
from kwplug.errors import KwplugWarning
from kwplug.plugins.ddp_comm_hooks import checkpointed_state
from kwplug.testing import PluginSandbox, run_distributed

OPTIONS = {"ratio": 0.1}
STEPS, SAVE_AT = 6, 3


def _train(directory: str, resume: bool) -> tuple[list[float], Any]:
    # STEPS steps of top-k training (saving after SAVE_AT), or the resumed run's last steps.
    handler = kwplug.DistributedDataParallelKwargs(comm_hook="topk", comm_state_option=OPTIONS)
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
    return torch.cat([p.detach().reshape(-1) for p in plain.parameters()]).tolist(), saved


def resume_worker(directory: str) -> dict[str, Any]:
    full, saved = _train(directory, resume=False)
    resumed, restored = _train(directory, resume=True)
    return {"full": full, "resumed": resumed, "saved": saved, "restored": restored}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("topk_checkpoint")
    with PluginSandbox(keep_installed=["kwplug-compress"]):
        return run_distributed(resume_worker, str(directory), nproc=2, timeout=120.0)


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
        load_resized_hooks([[live]], [[hook_state_dict(saving)]], sizes)
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
        load_resized_hooks([[live]], [[hook_state_dict(saving)]], (2, 1))
    assert any("model 0: TopKState (reset)" in str(w.message) for w in caught)
    assert fresh.state_dict() == {"residuals": {}}


def test_kwplug_core_does_not_name_the_hook() -> None:
    core = Path(kwplug.__file__).parent
    for path in core.rglob("*.py"):
        if path.is_relative_to(core / "plugins"):
            continue
        text = path.read_text(encoding="utf-8").lower()
        assert "topk" not in text and "kwplug_compress" not in text, path

"""A third-party, layout-dependent communication hook declares its state on its CommHook:
canonical buckets (``state_buckets``), saving and restoring, and its own resize rule. It
resumes bitwise at the same number of processes and resizes 2 -> 1 and 1 -> 2 by its rule,
with nothing of it in kwplug's core.

No ``from __future__ import annotations``: DDP compares hook annotations with objects.
"""

import warnings
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.distributed as dist

import kwplug
from kwplug.attached_state import attached_states
from kwplug.errors import KwplugWarning
from kwplug.plugins.ddp_comm_hooks import checkpointed_state
from kwplug.testing import resize_hook_state, run_distributed

# -- the plugin: "drift" adds half of this rank's previous gradient of the bucket -------------


class DriftState:
    """Per rank: the last gradient of each bucket, keyed by (canonical) bucket index."""

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group
        self.last: dict[Any, torch.Tensor] = {}
        self.steps = 0


def drift_hook(state: DriftState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket + 0.5 * (this rank's previous gradient of the same bucket)``."""
    buffer = bucket.buffer()
    key = bucket.index()
    previous = state.last.get(key)
    state.last[key] = buffer.clone()  # laid out like the buffer: layout-dependent
    if previous is not None:
        buffer.add_(previous, alpha=0.5)
    if bucket.is_last():
        state.steps += 1
    buffer.div_(dist.get_world_size(state.process_group))
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0])


def make_drift_state(process_group: Any, options: Mapping[str, Any]) -> DriftState:
    return DriftState(process_group)


def save_drift(state: DriftState) -> dict[str, Any]:
    keys = list(state.last)
    return {
        "keys": [list(k) for k in keys],
        "last": [state.last[k] for k in keys],
        "steps": state.steps,
    }


def load_drift(state: DriftState, saved: Mapping[str, Any]) -> None:
    pairs = zip(saved.get("keys", ()), saved.get("last", ()), strict=True)
    state.last = {tuple(int(i) for i in key): value.clone() for key, value in pairs}
    state.steps = int(saved["steps"])


def resize_drift(saved: Mapping[str, Any], old_world_size: int, new_world_size: int) -> Any:
    """Another size: the step count carries over, the last gradients (one rank's) do not."""
    return {"steps": saved["steps"]}


DRIFT_RULES: dict[str, Any] = {
    "state_buckets": lambda state: list(state.last),
    "state_dict": save_drift,
    "load_state_dict": load_drift,
    "resize": resize_drift,
    "resize_note": "last gradients reset, step count kept",
}

# -- 2-process worker --------------------------------------------------------------------------

STEPS, SAVE_AT = 6, 3


def _train(directory: str, resume: bool) -> tuple[list[float], Any]:
    kwplug.register_comm_hook(
        "drift", drift_hook, make_state=make_drift_state, replace=True, **DRIFT_RULES
    )
    # Small buckets: several per step, rebuilt by DDP after the first step.
    handler = kwplug.DistributedDataParallelKwargs(comm_hook="drift", bucket_cap_mb=0.0005)
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    (attached,) = attached_states(model)
    saved: Any = None
    if resume:
        accelerator.load_state(directory)
        saved = attached.state_dict()  # what was restored
    for step in range(SAVE_AT if resume else 0, STEPS):
        generator = torch.Generator().manual_seed(100 * dist.get_rank() + step)
        accelerator.backward(model(torch.randn(4, 8, generator=generator)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        if not resume and step + 1 == SAVE_AT:
            accelerator.save_state(directory)
            saved = attached.state_dict()
    plain = accelerator.unwrap_model(model)
    flat = torch.cat([p.detach().reshape(-1) for p in plain.parameters()]).tolist()
    kwplug.unregister_comm_hook("drift")
    return flat, saved


def resume_worker(directory: str) -> dict[str, Any]:
    full, saved = _train(directory, resume=False)
    resumed, restored = _train(directory, resume=True)
    return {"full": full, "resumed": resumed, "saved": saved, "restored": restored}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("drift_checkpoint")
    return run_distributed(resume_worker, str(directory), nproc=2, timeout=120.0)


def test_same_size_resume_restores_the_state_bitwise(runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        assert rank["saved"]["steps"] == rank["restored"]["steps"] == SAVE_AT
        assert rank["restored"]["keys"] == rank["saved"]["keys"]
        assert torch.equal(rank["restored"]["last"][0], rank["saved"]["last"][0])
        # Canonical keys: the sorted indices of each bucket's parameters.
        assert all(all(isinstance(i, int) for i in key) for key in rank["saved"]["keys"])
    assert not all(  # each rank saved its own gradients
        torch.equal(a, b)
        for a, b in zip(runs[0]["saved"]["last"], runs[1]["saved"]["last"], strict=True)
    )


@pytest.mark.parametrize("sizes", [(2, 1), (1, 2)])
def test_resize_follows_the_hooks_rule(runs: list[dict[str, Any]], sizes: tuple[int, int]) -> None:
    record = kwplug.CommHook("drift", drift_hook, make_drift_state, **DRIFT_RULES)
    saving = checkpointed_state(record, DriftState())
    saving.load_state_dict(runs[0]["saved"])
    fresh = DriftState()
    live = checkpointed_state(record, fresh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resize_hook_state(live, saving, old_world_size=sizes[0], new_world_size=sizes[1])
    (warning,) = [str(w.message) for w in caught if issubclass(w.category, KwplugWarning)]
    assert "model 0: DriftState (last gradients reset, step count kept)" in warning
    assert fresh.steps == SAVE_AT and fresh.last == {}


def test_compose_puts_a_layout_dependent_hook_behind_canonical_buckets() -> None:
    from kwplug.plugins.ddp_comm_hooks import compose

    record = kwplug.CommHook("drift", drift_hook, make_drift_state, **DRIFT_RULES)
    assert record.layout_dependent
    composed = compose(record, DriftState(), list(torch.nn.Linear(2, 2).parameters()))
    assert composed.__code__.co_name == "canonical_hook"
    plain = compose(kwplug.CommHook("drift", drift_hook), None)
    assert plain is drift_hook


@pytest.mark.parametrize(
    ("sizes", "error"), [((True, 1), TypeError), ((2, 0), ValueError), ((2.0, 1), TypeError)]
)
def test_resize_hook_state_checks_the_world_sizes(
    sizes: tuple[Any, Any], error: type[Exception]
) -> None:
    with pytest.raises(error, match="world_size"):
        resize_hook_state(None, None, old_world_size=sizes[0], new_world_size=sizes[1])

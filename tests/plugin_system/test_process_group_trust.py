"""Issue 12, items 9 and 10 (two processes): no silent unsynchronised training; a second
Accelerator says when its InitProcessGroupKwargs differs from the live group; a new
Accelerator after end_training() always forms a working group."""

from __future__ import annotations

import time
from datetime import timedelta

import attrs
import pytest
import torch
import torch.distributed as dist

import kwplug
from kwplug.errors import MissingFeatureError, PluginHookError
from kwplug.testing import run_distributed


@attrs.define
class _NoWrap(kwplug.KwargsHandler):
    """Implements wrap_model but never wraps (a plugin that declines for this model)."""

    @kwplug.hookimpl
    def wrap_model(self, model: torch.nn.Module) -> None:
        return None


def _prepare_unwrapped() -> str:
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[_NoWrap()])
    try:
        accelerator.prepare(torch.nn.Linear(2, 2))
    except PluginHookError as exc:
        return str(exc)
    finally:
        accelerator.end_training()
    return "prepared without error"


def test_unwrapped_model_with_several_processes_is_an_error() -> None:
    messages = run_distributed(_prepare_unwrapped, env={"KWPLUG_BLOCK_PLUGINS": "ddp"}, timeout=180)
    for message in messages:
        assert "2 processes are running but no plugin wrapped the model Linear" in message
        assert "gradients would never be synchronised" in message


def _accelerator_without_ddp() -> str:
    try:
        kwplug.Accelerator(cpu=True)
    except MissingFeatureError as exc:
        return f"{exc.feature}|{exc.hook}|{exc}"
    return "constructed without error"


def test_no_ddp_provider_with_several_processes_fails_at_construction() -> None:
    # Issue 18 item 4: DDP wrapping is asked for (WORLD_SIZE=2) and no plugin implements
    # wrap_model: Accelerator() refuses on every rank, naming the blocked built-in.
    messages = run_distributed(
        _accelerator_without_ddp, env={"KWPLUG_BLOCK_PLUGINS": "ddp"}, timeout=180
    )
    for message in messages:
        feature, hook, text = message.split("|", 2)
        assert (feature, hook) == ("DDP wrapping (WORLD_SIZE=2)", "wrap_model")
        assert (
            "built-in plugin 'ddp' (kwplug " in text and "blocked by KWPLUG_BLOCK_PLUGINS" in text
        )


def test_frozen_model_needs_no_wrapper() -> None:
    # Nothing to synchronise: an evaluation-only model may stay unwrapped (single process
    # check of the rule; the two-process refusal is tested above).
    from kwplug.accelerator._prepare import _require_synchronised

    class _Process:
        world_size = 2

    class _Setup:
        process = _Process()

    model = torch.nn.Linear(2, 2).requires_grad_(False)
    _require_synchronised(_Setup(), model)  # type: ignore[arg-type]


def _second_accelerator_with_other_timeout() -> str:
    first = kwplug.Accelerator(cpu=True)
    try:
        kwplug.Accelerator(
            cpu=True, kwargs_handlers=[kwplug.InitProcessGroupKwargs(timeout=timedelta(seconds=7))]
        )
    except ValueError as exc:
        return str(exc)
    finally:
        first.end_training()
    return "no error"


def test_second_accelerator_with_different_timeout_says_so() -> None:
    for message in run_distributed(_second_accelerator_with_other_timeout, timeout=180):
        assert "timeout 7 s" in message and "600 s" in message, message
        assert "end_training()" in message


def _same_settings_twice() -> str:
    handler = kwplug.InitProcessGroupKwargs(timeout=timedelta(seconds=90))
    first = kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])
    second = kwplug.Accelerator(cpu=True, kwargs_handlers=[handler])
    second.end_training()
    del first
    return "ok"


def test_second_accelerator_with_same_settings_is_fine() -> None:
    assert run_distributed(_same_settings_twice, timeout=180) == ["ok", "ok"]


def _groups_after_end_training(cycles: int) -> list[float]:
    sums = []
    for _ in range(cycles):
        accelerator = kwplug.Accelerator(cpu=True)
        value = torch.tensor([float(accelerator.process_index + 1)])
        dist.all_reduce(value)
        sums.append(float(value))
        accelerator.end_training()
        if accelerator.process_index == 1:
            time.sleep(3)  # rank 1 arrives 3 s late at the next rendezvous
    return sums


@pytest.mark.parametrize("attempt", range(2))
def test_new_accelerator_after_end_training_forms_a_working_group(attempt: int) -> None:
    results = run_distributed(_groups_after_end_training, 3, timeout=240)
    assert results == [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]

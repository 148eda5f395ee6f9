"""``accumulate``'s non-synchronising micro-batches ask the ``no_sync`` hook only when they
must (issue 31, goal 2): once per model while kwplug's own implementations alone answer it
and nothing watches the plugin manager; every time once tracing is on, a plugin or a user
handler implements the hook (registered before or after the first micro-batch), or an
Accelerator subclass overrides ``no_sync``. Gradients accumulate as before either way."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import attrs
import pluggy
import pytest
import torch

from kwplug import Accelerator, DistributedDataParallelKwargs, hookimpl
from kwplug._plugins._relays import FirstRelay

STEPS = 4


def counting(accelerator: Accelerator) -> list[str]:
    """Every one-answer hook call of ``accelerator`` from now on, by hook name (a relay in
    front of the manager's caller: it sees calls whether or not anything monitors)."""
    pm = accelerator.plugin_manager
    calls: list[str] = []
    ask = pm._calls.first

    def counted(hook: str, kwargs: dict[str, Any]) -> Any:
        calls.append(hook)
        return ask(hook, kwargs)

    pm.first = FirstRelay(counted)
    return calls


def train(accelerator: Accelerator, model: torch.nn.Module, batches: int) -> None:
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(1)
    for _ in range(batches):
        x = torch.randn(4, 8)
        with accelerator.accumulate(model):
            accelerator.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()


class Entered:
    """A context that counts its entries."""

    def __init__(self) -> None:
        self.entered = 0

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        self.entered += 1
        yield


class NoSyncPlugin:
    """A plugin (not a handler) answering ``no_sync`` with a counted context."""

    def __init__(self) -> None:
        self.seen = Entered()
        self.asked = 0

    @hookimpl
    def no_sync(self, model: torch.nn.Module) -> Any:
        self.asked += 1
        return self.seen.context()


def test_one_process_asks_no_sync_once_per_model_and_trains_as_before() -> None:
    torch.manual_seed(0)
    reference = torch.nn.Linear(8, 2)
    fast = Accelerator(cpu=True, gradient_accumulation_steps=STEPS)
    model = fast.prepare(torch.nn.Linear(8, 2))
    model.load_state_dict(reference.state_dict())
    calls = counting(fast)
    train(fast, model, 3 * STEPS)
    # 9 non-synchronising micro-batches, one hook call: the first.
    assert calls == ["no_sync"]
    assert fast.plan["no_sync"].plugin is None  # every built-in declined: nothing to enter

    # The same training through the hook on every micro-batch (tracing on) ends equal.
    slow = Accelerator(cpu=True, gradient_accumulation_steps=STEPS)
    other = slow.prepare(torch.nn.Linear(8, 2))
    other.load_state_dict(reference.state_dict())
    seen: list[str] = []
    slow.plugin_manager.add_hookcall_monitoring(lambda hook, *_: seen.append(hook), _ignore)
    train(slow, other, 3 * STEPS)
    assert seen.count("no_sync") == 9
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)


def _ignore(*_: Any) -> None:
    return None


def test_tracing_switched_on_later_sees_every_micro_batch() -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=STEPS)
    model = accelerator.prepare(torch.nn.Linear(8, 2))
    train(accelerator, model, STEPS)  # learnt: nothing to enter
    seen: list[str] = []
    undo = accelerator.plugin_manager.add_hookcall_monitoring(
        lambda hook, *_: seen.append(hook), _ignore
    )
    train(accelerator, model, STEPS)
    assert seen.count("no_sync") == STEPS - 1
    undo()
    calls = counting(accelerator)
    train(accelerator, model, STEPS)
    assert calls == []  # unwatched again: still nothing asked


@pytest.mark.parametrize("third_party", [False, True])
def test_a_plugin_registered_later_is_asked_at_every_micro_batch(third_party: bool) -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=STEPS)
    model = accelerator.prepare(torch.nn.Linear(8, 2))
    train(accelerator, model, STEPS)  # the fast path is learnt before the plugin comes
    plugin = NoSyncPlugin()
    accelerator.plugin_manager.register_plugin(
        plugin, "late:no_sync", "a late plugin", third_party=third_party
    )
    assert accelerator.plugin_manager.own_implementations("no_sync") is None
    train(accelerator, model, 2 * STEPS)
    assert plugin.asked == plugin.seen.entered == 2 * (STEPS - 1)
    assert accelerator.plan["no_sync"].plugin == "late:no_sync"
    # Unregistered: the registrations are those learnt before, whose answer holds again.
    accelerator.plugin_manager.unregister(name="late:no_sync")
    calls = counting(accelerator)
    train(accelerator, model, 2 * STEPS)
    assert calls == [] and plugin.asked == 2 * (STEPS - 1)


@attrs.define
class OwnNoSync(DistributedDataParallelKwargs):
    """A user's subclass of the built-in DDP handler with its own ``no_sync``."""

    asked: int = 0

    @hookimpl
    def no_sync(self, model: torch.nn.Module) -> Any:
        self.asked += 1
        return super().no_sync(model)


def test_a_user_handler_overriding_no_sync_is_asked_every_time() -> None:
    handler = OwnNoSync()
    accelerator = Accelerator(
        cpu=True, gradient_accumulation_steps=STEPS, kwargs_handlers=[handler]
    )
    model = accelerator.prepare(torch.nn.Linear(8, 2))
    train(accelerator, model, 2 * STEPS)
    assert handler.asked == 2 * (STEPS - 1)


def test_the_built_in_ddp_handler_given_by_the_user_keeps_the_fast_path() -> None:
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=STEPS,
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
    )
    assert accelerator.plugin_manager.own_implementations("no_sync") is not None
    model = accelerator.prepare(torch.nn.Linear(8, 2))
    calls = counting(accelerator)
    train(accelerator, model, 2 * STEPS)
    assert calls == ["no_sync"]


def test_own_implementations_is_none_while_watched() -> None:
    pm = Accelerator(cpu=True).plugin_manager
    impls = pm.own_implementations("no_sync")
    assert impls is not None and all(isinstance(i, pluggy.HookImpl) for i in impls)
    undo = pm.add_hookcall_monitoring(lambda *_: None, _ignore)
    assert pm.own_implementations("no_sync") is None
    undo()
    assert pm.own_implementations("no_sync") == impls


class SubclassedAccelerator(Accelerator):
    asked = 0

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        SubclassedAccelerator.asked += 1
        return super().no_sync(model)


def test_an_accelerator_subclass_overriding_no_sync_is_called() -> None:
    accelerator = SubclassedAccelerator(cpu=True, gradient_accumulation_steps=STEPS)
    model = accelerator.prepare(torch.nn.Linear(8, 2))
    train(accelerator, model, 2 * STEPS)
    assert SubclassedAccelerator.asked == 2 * (STEPS - 1)

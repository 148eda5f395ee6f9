"""Repeated construction copies what it built before (issue 31, goal 3): default handler
instances and option objects copied from pristine ones, hook callers made lazily, the
``comm_hooks`` merge kept; every Accelerator still independent and every change seen."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import attrs
import pluggy
import pytest

import kwplug
from kwplug import KwargsHandler, hookimpl
from kwplug._contracts import environ
from kwplug._contracts.pristine import Pristine, copier
from kwplug._plugins import _reuse, discover
from kwplug.accelerator import _setup_cache
from kwplug.plugins import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    TorchDynamoPlugin,
)
from kwplug.utils import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration

# Every built-in handler class registered by default (a new one is checked without a change
# here), and the ones this file names.
DEFAULTS = tuple(
    cls
    for r in discover()
    if r.builtin and r.loaded and (cls := r.handler_class) is not None and cls.register_default
)
NAMED = (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    TorchDynamoPlugin,
)


def test_every_named_default_is_checked() -> None:
    assert set(NAMED) <= set(DEFAULTS)


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    _reuse.clear()
    _setup_cache.clear()
    yield
    _reuse.clear()
    _setup_cache.clear()


def _fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in attrs.fields(type(obj))}


def _default(accelerator: kwplug.Accelerator, cls: type) -> Any:
    (found,) = [p for _, p in accelerator.plugin_manager.list_name_plugin() if type(p) is cls]
    return found


@pytest.mark.parametrize("cls", DEFAULTS, ids=lambda c: c.__name__)
def test_a_copied_default_handler_equals_a_new_one(cls: type) -> None:
    accelerators = [kwplug.Accelerator(cpu=True) for _ in range(3)]
    handlers = [_default(a, cls) for a in accelerators]
    assert handlers[1] is not handlers[2]
    for handler in handlers:
        assert type(handler) is cls and _fields(handler) == _fields(cls())


def test_built_in_handler_construction_depends_on_the_environment_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What makes copying them sound: two constructions in the same environment agree.
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "eager")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "true")
    for cls in DEFAULTS:
        first, second = cls(), cls()
        maker = copier(first)
        assert maker is not None, cls
        assert _fields(maker()) == _fields(second) == _fields(first)


def test_a_changed_environment_reaches_the_next_default_instance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kwplug.Accelerator(cpu=True)
    before = _default(kwplug.Accelerator(cpu=True), TorchDynamoPlugin)
    assert before.backend.value == "NO"
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "eager")
    after = _default(kwplug.Accelerator(cpu=True), TorchDynamoPlugin)
    assert after.backend.value == "EAGER" and _fields(after) == _fields(TorchDynamoPlugin())
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND")
    assert _default(kwplug.Accelerator(cpu=True), TorchDynamoPlugin).backend.value == "NO"


def test_changing_one_accelerators_defaults_never_reaches_another() -> None:
    a, b = kwplug.Accelerator(cpu=True), kwplug.Accelerator(cpu=True)
    ddp = _default(a, DistributedDataParallelKwargs)
    ddp.bucket_cap_mb = 50
    ddp.comm_state_option["matrix_approximation_rank"] = 2  # in place
    a.project_configuration.iteration = 7
    a.dataloader_config.even_batches = False
    for other in (b, kwplug.Accelerator(cpu=True)):
        assert _fields(_default(other, DistributedDataParallelKwargs)) == _fields(
            DistributedDataParallelKwargs()
        )
        assert other.project_configuration == ProjectConfiguration()
        assert other.dataloader_config == DataLoaderConfiguration()
        assert other.project_configuration is not a.project_configuration
        assert other.gradient_state.plugin_kwargs == {"num_steps": 1}


def test_default_option_objects_equal_new_ones() -> None:
    for _ in range(3):
        accelerator = kwplug.Accelerator(cpu=True, project_dir="out", split_batches=True)
        assert accelerator.project_configuration == ProjectConfiguration(project_dir="out")
        assert accelerator.dataloader_config == DataLoaderConfiguration(split_batches=True)
    steps = kwplug.Accelerator(cpu=True, gradient_accumulation_steps=3)
    assert steps.gradient_state.num_steps == 3
    assert GradientAccumulationPlugin(num_steps=2).to_kwargs() == {"num_steps": 2}


@attrs.define
class _Extra(KwargsHandler):
    @hookimpl
    def autocast(self, device_type: str) -> None:
        return None


def test_a_plugin_registered_on_one_manager_stays_there() -> None:
    a = kwplug.Accelerator(cpu=True)
    b = kwplug.Accelerator(cpu=True)
    a.plugin_manager.register(_Extra(), name="extra")
    assert [i.plugin_name for i in a.plugin_manager.hook.autocast.get_hookimpls()][-1] == "extra"
    for other in (b, kwplug.Accelerator(cpu=True)):
        assert other.plugin_manager.get_plugin("extra") is None
        names = [i.plugin_name for i in other.plugin_manager.hook.autocast.get_hookimpls()]
        assert "extra" not in names


def test_unregister_reaches_hook_callers_not_made_yet() -> None:
    kwplug.Accelerator(cpu=True)
    pm = kwplug.Accelerator(cpu=True).plugin_manager
    made = vars(pluggy.HookRelay)["__dict__"].__get__(pm.hook)  # past vars(), which makes all
    assert "make_profiler" not in made  # made on first use
    pm.unregister(name="kwplug:profile")
    assert pm.hook.make_profiler.get_hookimpls() == []
    assert pm.get_hookcallers(_default(kwplug.Accelerator(cpu=True), ProfileKwargs)) is None


def test_monitoring_sees_the_calls_of_a_copied_manager() -> None:
    kwplug.Accelerator(cpu=True)
    accelerator = kwplug.Accelerator(cpu=True)
    seen: list[str] = []
    undo = accelerator.plugin_manager.add_hookcall_monitoring(
        lambda hook, impls, kwargs: seen.append(hook), lambda *args: None
    )
    accelerator.plugin_manager.hook.make_scaler(device_type="cpu", mixed_precision="no")
    accelerator.plugin_manager.first.autocast(device_type="cpu", mixed_precision="bf16")
    undo()
    assert seen == ["make_scaler", "autocast"]


def test_a_replaced_comm_hook_record_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    compress = pytest.importorskip("kwplug_compress")  # a third-party plugin answering
    first = kwplug.Accelerator(cpu=True).comm_hooks["int8"]
    assert kwplug.Accelerator(cpu=True).comm_hooks["int8"] == first

    def other_int8(state: Any, bucket: Any) -> Any:  # pragma: no cover - never run
        return compress.int8_hook(state, bucket)

    monkeypatch.setattr(compress, "int8_hook", other_int8)
    assert kwplug.Accelerator(cpu=True).comm_hooks["int8"].hook is other_int8


def test_a_registered_comm_hook_is_seen() -> None:
    kwplug.Accelerator(cpu=True)
    record = kwplug.register_comm_hook("mine", lambda state, bucket: bucket.buffer())
    try:
        assert kwplug.Accelerator(cpu=True).comm_hooks["mine"] is record
    finally:
        kwplug.unregister_comm_hook("mine")
    assert "mine" not in kwplug.Accelerator(cpu=True).comm_hooks


def test_pristine_copies_only_what_it_can_copy_faithfully() -> None:
    @attrs.define
    class Foreign(KwargsHandler):  # not kwplug's own module: built every time
        value: int = 1

    assert copier(Foreign()) is None
    assert copier(ProfileKwargs(on_trace_ready=print)) is None  # a function: not plain
    store = Pristine()
    assert store.check()
    first = store.new(DistributedDataParallelKwargs)
    second = store.new(DistributedDataParallelKwargs)
    assert first == second and first is not second
    assert first.comm_state_option is not second.comm_state_option
    first.comm_state_option["x"] = 1  # the first object handed out is the user's too
    assert store.new(DistributedDataParallelKwargs).comm_state_option == {}
    assert store.new(GradientAccumulationPlugin, num_steps=1) != store.new(
        GradientAccumulationPlugin, num_steps=2
    )


def test_environ_get_answers_as_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KWPLUG_TEST_VALUE", "é")
    monkeypatch.delenv("KWPLUG_TEST_UNSET", raising=False)
    for name in ("KWPLUG_TEST_VALUE", "KWPLUG_TEST_UNSET", "PATH"):
        assert environ.get(name) == os.environ.get(name)
        assert environ.get(name, "d") == os.environ.get(name, "d")
    assert discover() is discover()


def test_environ_get_follows_a_replaced_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    # environ.get keeps each name's encoded form with the encoding it came from: an
    # os.environ that encodes names otherwise must be read with its own encoding.
    monkeypatch.setenv("KWPLUG_TEST_VALUE", "plain")
    assert environ.get("KWPLUG_TEST_VALUE") == "plain"  # kept under os.environ's encoding
    data = {b"alt:KWPLUG_TEST_VALUE": b"other"}
    other = os._Environ(  # type: ignore[attr-defined]
        data,
        lambda name: f"alt:{name}".encode(),
        lambda key: key.decode()[4:],
        str.encode,
        bytes.decode,
    )
    monkeypatch.setattr(os, "environ", other)
    assert environ.get("KWPLUG_TEST_VALUE") == "other"
    monkeypatch.undo()
    assert environ.get("KWPLUG_TEST_VALUE") == os.environ.get("KWPLUG_TEST_VALUE")


class _MoreCommHooks:
    @hookimpl
    def comm_hooks(self) -> dict[str, Any]:
        return {}


def test_comm_hooks_asked_without_a_caller_follow_registrations() -> None:
    # A copied manager answers comm_hooks from the template's implementations until the
    # hook's caller is made; register and unregister make it, and are seen from then on.
    kwplug.Accelerator(cpu=True)
    pm = kwplug.Accelerator(cpu=True).plugin_manager
    peeked = pm.hook.peek_hookimpls("comm_hooks")
    assert peeked is not None and peeked == pm.hook.comm_hooks.get_hookimpls()
    assert pm.hook.peek_hookimpls("comm_hooks") is None  # made: the caller answers now
    pm.register(_MoreCommHooks(), name="more")
    assert "more" in [name for name, _ in pm.each.comm_hooks()]
    other = kwplug.Accelerator(cpu=True).plugin_manager
    other.unregister(name="kwplug:ddp_comm_hooks")
    assert "kwplug:ddp_comm_hooks" not in [name for name, _ in other.each.comm_hooks()]
    assert "more" not in [name for name, _ in other.each.comm_hooks()]
    fresh = kwplug.Accelerator(cpu=True)  # the template is untouched by either manager
    assert "power_sgd" in fresh.comm_hooks and "kwplug:ddp_comm_hooks" in [
        name for name, _ in fresh.plugin_manager.each.comm_hooks()
    ]


def test_a_changed_register_default_reaches_the_next_accelerator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # register_default is read once per construction for both the manager template's key
    # and the set-up answers' key: a change between two constructions reaches both.
    kwplug.Accelerator(cpu=True)
    assert kwplug.Accelerator(cpu=True).plugin_manager.get_plugin("kwplug:profile") is not None
    monkeypatch.setattr(ProfileKwargs, "register_default", False)
    accelerator = kwplug.Accelerator(cpu=True)
    assert accelerator.plugin_manager.get_plugin("kwplug:profile") is None
    monkeypatch.undo()
    assert kwplug.Accelerator(cpu=True).plugin_manager.get_plugin("kwplug:profile") is not None


# -- threads: another thread's change during a construction is never kept ------------------------


def _dynamo_backend(accelerator: Any) -> str:
    (plugin,) = [
        p for _, p in accelerator.plugin_manager.list_name_plugin() if type(p) is TorchDynamoPlugin
    ]
    return str(plugin.backend.value)


def test_a_default_built_while_another_thread_changes_the_environment_is_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The interleaving forced in one thread: this construction's TorchDynamoPlugin() has read
    # ACCELERATE_DYNAMO_BACKEND (unset) when "another thread" sets it and starts an
    # Accelerator (which records the new environment). The instance built here stands for the
    # old environment and must not become the copy handed out under the new one.
    import kwplug.plugins.dynamo as dynamo

    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    _reuse.clear()
    kwplug.Accelerator(cpu=True)
    real = dynamo.str_to_bool
    fired: list[bool] = []

    def other_thread_runs(value: Any) -> Any:
        if not fired:
            fired.append(True)
            monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "eager")
            _reuse._defaults.check()
        return real(value)

    monkeypatch.setattr(dynamo, "str_to_bool", other_thread_runs)
    _reuse._defaults.clear()  # so that this construction builds its defaults
    assert _dynamo_backend(kwplug.Accelerator(cpu=True)) == "NO"  # built before the change
    monkeypatch.setattr(dynamo, "str_to_bool", real)
    assert fired
    for _ in range(3):
        assert _dynamo_backend(kwplug.Accelerator(cpu=True)) == "EAGER"


def test_a_hook_registered_during_a_comm_hooks_merge_is_not_kept_after_it_goes() -> None:
    # Another thread registers a hook between the merge's key and its merge: the key and the
    # merge read one snapshot of the registry, so the hook is not kept once unregistered.
    import kwplug.comm_hooks as comm_hooks

    fsdp = pytest.importorskip("kwplug_fsdp")  # a handler the set-up cache does not replay
    kwplug.Accelerator(cpu=True)
    real = comm_hooks._same_inputs
    registered: list[bool] = []

    def other_thread_registers(new: Any, old: Any) -> bool:
        comm_hooks._same_inputs = real  # type: ignore[assignment]
        kwplug.register_comm_hook("raced", lambda _state, bucket: bucket.buffer())
        registered.append(True)
        return real(new, old)

    comm_hooks._last_merge = ((("another merge",), ()), {})  # this construction merges
    comm_hooks._same_inputs = other_thread_registers  # type: ignore[assignment]
    try:
        kwplug.Accelerator(cpu=True, kwargs_handlers=[fsdp.FullyShardedKwargs()])
    finally:
        comm_hooks._same_inputs = real  # type: ignore[assignment]
        if registered:
            kwplug.unregister_comm_hook("raced")
    assert registered
    for _ in range(2):
        assert "raced" not in kwplug.Accelerator(cpu=True).comm_hooks

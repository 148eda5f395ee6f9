"""The plugin contract: precedence, handler validation, per-Accelerator registration, hooks."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import attrs
import pytest
import torch

import kwplug
from kwplug import AutocastKwargs, GradScalerKwargs, KwargsHandler, hookimpl
from kwplug.hookspecs import HOOKS, HandlerSpec


@attrs.define
class RecordingAutocast(KwargsHandler):
    """A third-party-style handler: answers autocast for cpu with float16 and records calls."""

    calls: list[str] = attrs.field(factory=list)

    @hookimpl
    def autocast(self, device_type: str) -> Any:  # a subset of the spec's arguments
        self.calls.append(device_type)
        return functools.partial(torch.autocast, device_type, dtype=torch.float16)


@attrs.define
class DecliningAutocast(KwargsHandler):
    declined: int = 0

    @hookimpl
    def autocast(self) -> None:
        self.declined += 1
        return None


def test_hookspecs_are_documented_and_firstresult() -> None:
    # Every spec is declared with kwplug.hookspecs.spec, so its metadata lives in one place.
    specs = {n for n in dir(HandlerSpec) if not n.startswith("_")}
    assert specs == set(HOOKS)
    for name, info in HOOKS.items():
        fn = getattr(HandlerSpec, name)
        assert fn.__doc__ and "Called by" in fn.__doc__, name
        assert ("firstresult``: yes" in fn.__doc__) is info.firstresult, name
        assert fn.kwplug_spec["firstresult"] is info.firstresult, name


def test_user_handler_answers_before_builtin_default() -> None:
    handler = RecordingAutocast()
    accelerator = kwplug.Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[handler])
    assert handler.calls == ["cpu"]
    with accelerator.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.float16  # not the built-in bf16


def test_declining_handler_falls_through_to_default() -> None:
    handler = DecliningAutocast()
    accelerator = kwplug.Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[handler])
    assert handler.declined == 1
    with accelerator.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_first_user_handler_in_list_wins() -> None:
    first, second = RecordingAutocast(), DecliningAutocast()
    kwplug.Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[first, second])
    assert first.calls == ["cpu"] and second.declined == 0
    first, second = RecordingAutocast(), DecliningAutocast()
    kwplug.Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[second, first])
    assert first.calls == ["cpu"] and second.declined == 1


def test_per_call_handler_answers_first_without_registration() -> None:
    accelerator = kwplug.Accelerator(mixed_precision="bf16", cpu=True)
    handler = RecordingAutocast()
    with accelerator.autocast(handler):
        assert torch.get_autocast_dtype("cpu") == torch.float16
    assert handler.calls == ["cpu"]
    assert accelerator.plugin_manager.get_name(handler) is None
    with accelerator.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_subclass_of_builtin_replaces_it() -> None:
    @attrs.define
    class Fp16Scaler(GradScalerKwargs):
        @hookimpl
        def make_scaler(self, device_type: str, mixed_precision: str) -> Any:
            return torch.amp.GradScaler(device_type, init_scale=8.0)

    accelerator = kwplug.Accelerator(
        mixed_precision="fp16", cpu=True, kwargs_handlers=[Fp16Scaler()]
    )
    assert accelerator.scaler is not None and accelerator.scaler.get_scale() == 8.0
    names = accelerator.plugin_manager.list_name_plugin()
    assert not any(
        isinstance(p, GradScalerKwargs) and type(p) is GradScalerKwargs for _, p in names
    )


def test_duplicate_handler_class_is_value_error() -> None:
    with pytest.raises(ValueError, match=r"kwargs_handlers\[0\] and kwargs_handlers\[1\]"):
        kwplug.Accelerator(kwargs_handlers=[AutocastKwargs(), AutocastKwargs(enabled=False)])


@pytest.mark.parametrize("bad", [object(), {"enabled": True}, 3, AutocastKwargs])
def test_foreign_objects_are_type_errors(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"KwargsHandler|instance"):
        kwplug.Accelerator(kwargs_handlers=[bad])


def test_kwargs_handlers_must_be_a_list() -> None:
    with pytest.raises(TypeError, match="list"):
        kwplug.Accelerator(kwargs_handlers=AutocastKwargs())  # type: ignore[arg-type]


def test_bad_mixed_precision() -> None:
    with pytest.raises(ValueError, match="'no', 'fp16', 'bf16'"):
        kwplug.Accelerator(mixed_precision="fp8")


def test_equal_handlers_in_two_accelerators_do_not_collide() -> None:
    # attrs handlers compare by value; pluggy refuses an object equal to a registered one.
    a = kwplug.Accelerator(kwargs_handlers=[AutocastKwargs()])
    b = kwplug.Accelerator(kwargs_handlers=[AutocastKwargs()])
    shared = AutocastKwargs()
    c = kwplug.Accelerator(kwargs_handlers=[shared])
    d = kwplug.Accelerator(kwargs_handlers=[shared])
    assert AutocastKwargs() == AutocastKwargs()
    for acc in (a, b, c, d):
        registered = [p for _, p in acc.plugin_manager.list_name_plugin()]
        assert sum(isinstance(p, AutocastKwargs) for p in registered) == 1
    assert any(p is shared for _, p in c.plugin_manager.list_name_plugin())


def test_invalid_hookimpl_on_user_handler_is_type_error() -> None:
    @attrs.define
    class Broken(KwargsHandler):
        @hookimpl
        def autocast(self, device_type: str, not_an_argument: int) -> None:
            return None

    with pytest.raises(TypeError, match="Broken.*invalid hook implementation"):
        kwplug.Accelerator(kwargs_handlers=[Broken()])


def test_wrap_model_hook_from_handler_and_type_check() -> None:
    @attrs.define
    class Wrapper(KwargsHandler):
        @hookimpl
        def wrap_model(self, model: torch.nn.Module, world_size: int) -> torch.nn.Module:
            return torch.nn.Sequential(model)

    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[Wrapper()])
    model = torch.nn.Linear(2, 2)
    wrapped = accelerator.prepare(model)
    assert isinstance(wrapped, torch.nn.Sequential) and wrapped[0] is model

    @attrs.define
    class Wrong(KwargsHandler):
        @hookimpl
        def wrap_model(self, model: torch.nn.Module) -> Any:
            return "not a module"

    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        kwplug.Accelerator(cpu=True, kwargs_handlers=[Wrong()]).prepare(model)


def test_prepare_single_process_returns_same_order() -> None:
    accelerator = kwplug.Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 2)))
    out = accelerator.prepare(model, optimizer, loader, "other")
    assert out[0] is model and out[1].optimizer is optimizer and out[3] == "other"
    assert isinstance(out[2], torch.utils.data.DataLoader) and len(out[2]) == len(loader)
    assert [b[0].shape for b in out[2]] == [b[0].shape for b in loader]
    assert accelerator.unwrap_model(model) is model


def test_profile_without_profiler_plugin_is_runtime_error() -> None:
    @attrs.define
    class NoProfiler(KwargsHandler):
        @hookimpl
        def make_profiler(self) -> None:
            return None

    accelerator = kwplug.Accelerator(cpu=True)
    accelerator.plugin_manager.set_blocked("kwplug:profile")
    accelerator.plugin_manager.unregister(name="kwplug:profile")
    with pytest.raises(RuntimeError, match="make_profiler"), accelerator.profile(NoProfiler()):
        pass


def test_comm_hook_registry_and_duplicates() -> None:
    def hook(state: Any, bucket: Any) -> Any:
        raise AssertionError("not called here")

    record = kwplug.register_comm_hook("test-noop", hook)
    try:
        assert record.name == "test-noop"
        assert kwplug.Accelerator(cpu=True).comm_hooks["test-noop"].hook is hook
        with pytest.raises(ValueError, match="already registered"):
            kwplug.register_comm_hook("test-noop", hook)
        with pytest.raises(TypeError, match="callable"):
            kwplug.register_comm_hook("test-x", 3)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="non-empty"):
            kwplug.register_comm_hook("", hook)
    finally:
        kwplug.unregister_comm_hook("test-noop")


def test_comm_hooks_contributed_by_two_plugins_conflict() -> None:
    def hook(state: Any, bucket: Any) -> Any:
        return None

    @attrs.define
    class A(KwargsHandler):
        @hookimpl
        def comm_hooks(self) -> Any:
            return {"same": kwplug.CommHook("same", hook)}

    @attrs.define
    class B(KwargsHandler):
        @hookimpl
        def comm_hooks(self) -> Any:
            return {"same": kwplug.CommHook("same", hook)}

    with pytest.raises(ValueError, match=r"'same' is provided twice.*\[0\].*A\).*\[1\].*B\)"):
        kwplug.Accelerator(cpu=True, kwargs_handlers=[A(), B()])


def test_nullcontext_factory_when_no_plugin_answers() -> None:
    accelerator = kwplug.Accelerator(mixed_precision="bf16", cpu=True)
    accelerator.plugin_manager.unregister(name="kwplug:autocast")
    ctx = accelerator.autocast(DecliningAutocast())
    assert isinstance(ctx, contextlib.nullcontext)


def test_plan_records_who_answered_each_hook() -> None:
    handler = RecordingAutocast()
    accelerator = kwplug.Accelerator(mixed_precision="fp16", cpu=True, kwargs_handlers=[handler])
    autocast = accelerator.plan["autocast"]
    assert autocast.plugin == "user[0]:test_accelerator_core.RecordingAutocast"
    assert accelerator.plan["make_scaler"].plugin == "kwplug:grad_scaler"
    accelerator.prepare(torch.nn.Linear(2, 2))
    wrap = accelerator.plan["wrap_model"]
    assert wrap.plugin is None and "kwplug:ddp" in wrap.asked  # DDP declines in 1 process


def test_hook_error_from_a_handler_names_it() -> None:
    @attrs.define
    class Exploding(KwargsHandler):
        @hookimpl
        def make_scaler(self) -> None:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as info:
        kwplug.Accelerator(mixed_precision="fp16", kwargs_handlers=[Exploding()])
    notes = getattr(info.value, "__notes__", [])
    assert any("make_scaler" in n and "Exploding" in n for n in notes)

"""The typed hook relays (``plugins.first.<hook>``, ``plugins.each.<hook>``) mirror
``HandlerSpec`` exactly, check their arguments at the call, and every call they make is seen by
pluggy's tracing and monitoring."""

from __future__ import annotations

import inspect
import threading
import types
from collections.abc import Sequence
from typing import Any

import attrs
import pluggy
import pytest

from kwplug import KwargsHandler, hookimpl
from kwplug._plugins import KwplugPluginManager
from kwplug._plugins._relays import EachRelay, FirstRelay
from kwplug.hookspecs import HOOKS, HandlerSpec


def _public_methods(cls: type) -> dict[str, Any]:
    return {n: m for n, m in vars(cls).items() if callable(m) and not n.startswith("_")}


@pytest.mark.parametrize(
    ("relay", "firstresult"), [(FirstRelay, True), (EachRelay, False)], ids=["first", "each"]
)
def test_relay_methods_mirror_the_specs(relay: type, firstresult: bool) -> None:
    wanted = [name for name, info in HOOKS.items() if info.firstresult is firstresult]
    methods = _public_methods(relay)
    assert list(methods) == wanted  # every hook of its kind, in the spec's order, nothing else
    for name, method in methods.items():
        spec = inspect.signature(getattr(HandlerSpec, name))
        mine = inspect.signature(method)
        spec_params = list(spec.parameters.values())[1:]  # without self
        my_params = list(mine.parameters.values())[1:]
        assert [p.name for p in my_params] == [p.name for p in spec_params], name
        for mp, sp in zip(my_params, spec_params, strict=True):
            assert mp.kind is inspect.Parameter.KEYWORD_ONLY, (name, mp.name)
            assert mp.default is inspect.Parameter.empty, (name, mp.name)
            assert mp.annotation == sp.annotation, (name, mp.name)
        expected = (
            spec.return_annotation if firstresult else f"list[tuple[str, {spec.return_annotation}]]"
        )
        assert mine.return_annotation == expected, name


@pytest.mark.parametrize("relay", [FirstRelay, EachRelay])
def test_relay_methods_pass_their_own_name_and_arguments(relay: type) -> None:
    asked: list[tuple[str, dict[str, Any]]] = []

    def ask(hook: str, kwargs: dict[str, Any]) -> Any:
        asked.append((hook, kwargs))
        return "answer"

    instance = relay(ask)
    for name, method in _public_methods(relay).items():
        params = list(inspect.signature(method).parameters)[1:]
        values = {p: object() for p in params}
        assert getattr(instance, name)(**values) == "answer"
        assert asked.pop() == (name, values)


def test_a_missing_or_misspelt_argument_is_a_type_error_naming_hook_and_argument() -> None:
    pm = KwplugPluginManager()
    with pytest.raises(TypeError, match=r"autocast\(\) missing 1 required .*'mixed_precision'"):
        pm.first.autocast(device_type="cpu")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"autocast\(\) got an unexpected keyword .*'devce_type'"):
        pm.first.autocast(devce_type="cpu", mixed_precision="no")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"load_handler_state\(\) .*'state'"):
        pm.each.load_handler_state()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="positional"):
        pm.first.no_sync(None)  # type: ignore[call-arg]
    with pytest.raises(AttributeError, match="autocats"):
        pm.first.autocats  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(AttributeError, match="comm_hooks"):
        pm.first.comm_hooks  # type: ignore[attr-defined]  # noqa: B018  # a collecting hook


def _everything() -> Any:
    # A plain object plugin answering every hook (no argument: pluggy passes none).
    answers: dict[str, Any] = {
        name: object() if info.firstresult else {name: 1}
        for name, info in HOOKS.items()
        if info.firstresult or name in ("comm_hooks", "trackers", "handler_state")
    }
    plugin = types.SimpleNamespace(answers=answers)
    for name in HOOKS:

        def answer(name: str = name) -> Any:  # the default binds the name; pluggy passes none
            return answers.get(name)

        setattr(plugin, name, hookimpl(specname=name)(answer))
    return plugin


class _Watch:
    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.before: list[tuple[str, list[str], dict[str, Any]]] = []
        self.after: list[tuple[str, Any]] = []
        self.trace: list[str] = []
        pm.trace.root.setwriter(self.trace.append)
        pm.enable_tracing()
        pm.add_hookcall_monitoring(self._before, self._after)

    def _before(self, hook: str, impls: Sequence[pluggy.HookImpl], kwargs: Any) -> None:
        self.before.append((hook, [i.plugin_name for i in reversed(impls)], dict(kwargs)))

    def _after(self, outcome: pluggy.Result[Any], hook: str, impls: Any, kwargs: Any) -> None:
        self.after.append((hook, outcome.get_result()))


@attrs.define
class _PerCall(KwargsHandler):
    @hookimpl
    def autocast(self) -> str:
        return "per-call"

    @hookimpl
    def make_profiler(self) -> None:
        return None


def test_tracing_and_monitoring_see_every_relay_call() -> None:
    pm = KwplugPluginManager()
    plugin = _everything()
    pm.register_plugin(plugin, "test:everything", "the test plugin")
    watch = _Watch(pm)
    called: list[str] = []
    for relay in (pm.first, pm.each):
        for name, method in _public_methods(type(relay)).items():
            params = list(inspect.signature(method).parameters)[1:]
            kwargs = {p: f"<{p}>" for p in params}
            got = getattr(relay, name)(**kwargs)
            called.append(name)
            before_hook, asked, seen_kwargs = watch.before[-1]
            assert (before_hook, asked, seen_kwargs) == (name, ["test:everything"], kwargs)
            if relay is pm.first:
                assert got is plugin.answers[name] is pm.plan[name].result
                assert pm.plan[name].plugin == "test:everything"
                assert watch.after[-1] == (name, got)
            else:
                assert got == [("test:everything", plugin.answers.get(name))]
    assert [hook for hook, _, _ in watch.before] == called
    assert sorted(called) == sorted(HOOKS)  # every hook (the relays' order: the test above)
    assert [hook for hook, _ in watch.after] == called
    text = "".join(watch.trace)
    for name in HOOKS:
        assert f"{name} [hook]" in text and f"finish {name} -->" in text, name

    # The per-call relay and the one-plugin relay go through the same caller.
    watch.before.clear()
    before = dict(pm.plan)
    per_call = pm.first_with(_PerCall())
    assert per_call.autocast(device_type="cpu", mixed_precision="no") == "per-call"
    profiler = per_call.make_profiler(device_type="cpu", rank=0)  # the handler declines
    assert profiler is plugin.answers["make_profiler"]
    assert pm.plan == before  # a per-call answer is not recorded in the plan
    assert pm.each_of("test:everything").trackers() == [("test:everything", {"trackers": 1})]
    assert pm.each_of("nobody").trackers() == []
    assert [(h, asked) for h, asked, _ in watch.before] == [
        ("autocast", ["<per-call handler>", "test:everything"]),
        ("make_profiler", ["<per-call handler>", "test:everything"]),
        ("trackers", ["test:everything"]),
        ("trackers", []),
    ]


@attrs.define
class _Answering(KwargsHandler):
    value: str = "a"

    @hookimpl
    def autocast(self) -> str:
        return self.value


def test_a_registration_after_a_call_is_seen_by_the_next_call() -> None:
    pm = KwplugPluginManager()
    pm.register_plugin(_Answering("old"), "test:old", "old")
    assert pm.first.autocast(device_type="cpu", mixed_precision="no") == "old"
    pm.register_plugin(_Answering("new"), "test:new", "new")
    assert pm.first.autocast(device_type="cpu", mixed_precision="no") == "new"
    assert pm.plan["autocast"].asked == ("test:new",)
    pm.unregister(name="test:new")
    assert pm.first.autocast(device_type="cpu", mixed_precision="no") == "old"
    assert pm.plan["autocast"].plugin == "test:old"


@attrs.define
class _Nested(KwargsHandler):
    pm: Any = None

    @hookimpl
    def make_scaler(self) -> Any:
        return None  # declines, after asking another hook

    @hookimpl
    def comm_hooks(self) -> Any:
        inner = self.pm.first.autocast(device_type="cpu", mixed_precision="no")
        return {"inner": inner}


def test_a_hook_called_from_inside_another_records_each_its_own_answers() -> None:
    pm = KwplugPluginManager()
    pm.register_plugin(_Answering("x"), "test:answering", "answering")
    pm.register_plugin(_Nested(pm), "test:nested", "nested")
    assert pm.each.comm_hooks() == [("test:nested", {"inner": "x"})]
    assert pm.plan["autocast"].asked == ("test:answering",)


@attrs.define
class _Listed(KwargsHandler):
    items: list[int] = attrs.field(
        factory=list, validator=attrs.validators.deep_iterable(attrs.validators.instance_of(int))
    )

    @hookimpl
    def autocast(self) -> Any:
        return None


def test_an_in_place_change_is_caught_at_every_call() -> None:
    pm = KwplugPluginManager()
    handler = _Listed()
    pm.register_plugin(handler, "test:listed", "listed")
    assert pm.first.autocast(device_type="cpu", mixed_precision="no") is None
    handler.items.append("x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="_Listed was changed after construction"):
        pm.first.autocast(device_type="cpu", mixed_precision="no")


class _Meeting:
    """Answers ``comm_hooks`` with the calling thread's name, once both threads are inside."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=10)

    @hookimpl
    def comm_hooks(self) -> Any:
        self.barrier.wait()
        return {threading.current_thread().name: 1}


def test_calls_from_two_threads_keep_their_own_answers() -> None:
    pm = KwplugPluginManager()
    pm.register_plugin(_Meeting(), "test:meeting", "meeting")
    got: dict[str, Any] = {}

    def call() -> None:
        got[threading.current_thread().name] = pm.each.comm_hooks()

    threads = [threading.Thread(target=call, name=f"t{i}") for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert got == {name: [("test:meeting", {name: 1})] for name in ("t0", "t1")}

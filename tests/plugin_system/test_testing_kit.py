"""kwplug.testing: the conformance check, the sandbox and the torchrun helper."""

from __future__ import annotations

import functools
import os
from typing import Any, ClassVar

import attrs
import pytest
import torch

import kwplug
from kwplug import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    hookimpl,
)
from kwplug.testing import (
    DistributedRunError,
    PluginSandbox,
    check_handler,
    conformance_problems,
    run_distributed,
)

# -- check_handler -----------------------------------------------------------------------

BUILTIN_EXAMPLES: list[tuple[type[KwargsHandler], dict[str, Any], tuple[str, ...]]] = [
    (AutocastKwargs, {"enabled": False, "cache_enabled": True}, ()),
    (GradScalerKwargs, {"init_scale": 1024.0, "growth_interval": 100, "enabled": False}, ()),
    (InitProcessGroupKwargs, {"backend": "gloo", "init_method": "env://"}, ()),
    (DistributedDataParallelKwargs, {"bucket_cap_mb": 10, "comm_hook": "bf16"}, ()),
    (ProfileKwargs, {"record_shapes": True, "with_flops": True}, ()),
]


@pytest.mark.parametrize(("cls", "examples", "accepts_any"), BUILTIN_EXAMPLES)
def test_builtin_handlers_conform(
    cls: type[KwargsHandler], examples: dict[str, Any], accepts_any: tuple[str, ...]
) -> None:
    check_handler(cls, examples=examples, accepts_any=accepts_any)


@attrs.define
class Conforming(KwargsHandler):
    """A minimal well-behaved third-party handler."""

    dtype: str = attrs.field(default="bf16", validator=attrs.validators.in_(("bf16", "fp16")))

    @hookimpl
    def autocast(self) -> None:
        return None


@attrs.define
class Sloppy(KwargsHandler):
    """Everything a handler should not do."""

    anything: Any = None  # no validator: accepts nonsense
    required: int = attrs.field(kw_only=True)  # no default

    @hookimpl
    def autocats(self) -> None:  # misspelt hook name
        return None


class NotAttrs(KwargsHandler):
    pass


@attrs.define
class NoHooks(KwargsHandler):
    size: int = attrs.field(default=1, validator=attrs.validators.instance_of(int))


@attrs.define
class Unpicklable(KwargsHandler):
    callback: Any = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.is_callable())
    )

    @hookimpl
    def autocast(self) -> None:
        return None


@attrs.define
class WrongDevices(Conforming):
    device_types: ClassVar[Any] = frozenset({""})


def test_a_conforming_third_party_handler_passes() -> None:
    check_handler(Conforming, examples={"dtype": "fp16"})


def test_every_problem_is_listed_at_once() -> None:
    problems = conformance_problems(Sloppy)
    assert problems == [
        "field 'required' has no default",
        "Sloppy() raised TypeError: " + (problems[1].split("TypeError: ", 1)[1]),
    ]
    with pytest.raises(AssertionError, match="does not conform"):
        check_handler(Sloppy)


def test_problems_found() -> None:
    assert conformance_problems(int) == ["<class 'int'> is not a subclass of kwplug.KwargsHandler"]
    assert conformance_problems(NotAttrs) == ["NotAttrs is not decorated with @attrs.define"]
    assert any("no kwplug hook" in p for p in conformance_problems(NoHooks))
    assert any("device_types must be" in p for p in conformance_problems(WrongDevices))
    problems = conformance_problems(Unpicklable, examples={"callback": lambda: None})
    assert any("cannot be pickled" in p for p in problems), problems
    assert any(
        "equals the default" in p
        for p in conformance_problems(Conforming, examples={"dtype": "bf16"})
    )
    assert any(
        "unknown field 'nope'" in p for p in conformance_problems(Conforming, accepts_any=["nope"])
    )


@attrs.define
class AcceptsAnything(KwargsHandler):
    payload: Any = None

    @hookimpl
    def autocast(self) -> None:
        return None


def test_fields_that_accept_anything_are_declared() -> None:
    assert conformance_problems(AcceptsAnything) == [
        "AcceptsAnything(payload=<nonsense>) was accepted",
        "assigning nonsense to payload was accepted (validators on setattr?)",
    ]
    check_handler(AcceptsAnything, accepts_any=["payload"])


@attrs.define
class Misspelt(KwargsHandler):
    @hookimpl
    def wrap_modle(self) -> None:
        return None


def test_misspelt_hook_is_reported() -> None:
    problems = conformance_problems(Misspelt)
    assert problems == [
        "invalid hook implementation: unknown hook 'wrap_modle' in plugin Misspelt()"
    ], problems


# -- the sandbox ---------------------------------------------------------------------------


@attrs.define
class ScalerOff(KwargsHandler):
    register_default: ClassVar[bool] = True

    @hookimpl
    def make_scaler(self) -> Any:
        return torch.amp.GradScaler("cpu", enabled=False)


def test_sandbox_isolates_discovery_and_restores_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KWPLUG_PLUGINS", "")  # would hide every third-party plugin

    def listing() -> list[tuple[str, str, str]]:
        return [(r.name, r.distribution, r.status) for r in kwplug.discover()]

    before = listing()
    with PluginSandbox() as sandbox:
        assert "KWPLUG_PLUGINS" not in os.environ
        assert {r.distribution for r in sandbox.records()} == {"kwplug"}
        record = sandbox.add(ScalerOff, name="scaler-off", distribution="kwplug-scaler-off")
        assert (record.status, record.hooks, record.source) == (
            "loaded",
            ("make_scaler",),
            "third-party",
        )
        accelerator = sandbox.accelerator(mixed_precision="fp16")
        assert accelerator.plan["make_scaler"].plugin == "kwplug-scaler-off:scaler-off"
        assert accelerator.scaler is not None and not accelerator.scaler.is_enabled()
    assert os.environ["KWPLUG_PLUGINS"] == ""
    assert listing() == before
    assert all(name != "scaler-off" for name, _, _ in listing())


def test_leaving_a_sandbox_does_not_load_what_is_installed_outside(
    kwplug_plugins: PluginSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Outside the inner sandbox: a broken plugin is installed and KWPLUG_STRICT_PLUGINS=1 (as
    # docs/writing-plugins.md says to run a plugin's tests). Leaving the inner sandbox used to
    # rediscover the outer environment at once, so every test using the kwplug_plugins
    # fixture errored at teardown with PluginLoadError (and warned about plugins it hid).
    kwplug_plugins.add("kwplug_no_such_module:Handler", name="broken", distribution="kwplug-bad")
    monkeypatch.setenv("KWPLUG_STRICT_PLUGINS", "1")
    with PluginSandbox() as sandbox:
        assert {r.distribution for r in sandbox.records()} == {"kwplug"}
    # The outer environment is discovered when it is used, strictly, as before.
    with pytest.raises(kwplug.PluginLoadError, match="'broken' \\(kwplug-bad 0.0.0\\)"):
        kwplug.discover()


def test_fixture_manager_has_the_builtins(kwplug_plugin_manager: Any) -> None:
    names = {name for name, _ in kwplug_plugin_manager.list_name_plugin()}
    assert "kwplug:ddp" in names and "kwplug:autocast" in names


def test_sandbox_refuses_what_an_entry_point_cannot_name(kwplug_plugins: PluginSandbox) -> None:
    @attrs.define
    class Local(KwargsHandler):
        pass

    with pytest.raises(ValueError, match="top level of an importable module"):
        kwplug_plugins.add(Local)
    with pytest.raises(ValueError, match="not an instance"):
        kwplug_plugins.add(Conforming())
    kwplug_plugins.add(Conforming, name="c")
    with pytest.raises(ValueError, match="already added"):
        kwplug_plugins.add(Conforming, name="c")


# -- run_distributed -----------------------------------------------------------------------


def all_reduce_rank(scale: int) -> dict[str, Any]:
    """Runs on every rank: an Accelerator joins gloo, all-reduces the rank."""
    accelerator = kwplug.Accelerator()
    total = accelerator.reduce(torch.tensor(float(accelerator.process_index * scale)))
    return {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "backend": torch.distributed.get_backend(),
        "total": total.item(),
    }


def fail_on_rank_one() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank one is unhappy")


def sleep_forever() -> None:
    import time

    time.sleep(600)


def test_run_distributed_returns_each_ranks_result() -> None:
    results = run_distributed(all_reduce_rank, 10, nproc=2, timeout=120)
    assert results == [
        {"rank": 0, "world_size": 2, "backend": "gloo", "total": 10.0},
        {"rank": 1, "world_size": 2, "backend": "gloo", "total": 10.0},
    ]


def test_run_distributed_reports_the_failing_rank() -> None:
    with pytest.raises(DistributedRunError, match=r"(?s)rank 1 raised.*ValueError: rank one"):
        run_distributed(fail_on_rank_one, nproc=2, timeout=120)


def test_run_distributed_kills_a_job_past_its_timeout() -> None:
    with pytest.raises(DistributedRunError, match="timed out after 15 s"):
        run_distributed(sleep_forever, nproc=1, timeout=15)


def test_run_distributed_needs_an_importable_function() -> None:
    with pytest.raises(ValueError, match="module-level function"):
        run_distributed(lambda: None)


def third_party_plugins() -> list[tuple[str, str]]:
    """Runs on every rank: the third-party plugins this process loads."""
    return sorted((r.distribution, r.name) for r in kwplug.discover() if not r.builtin and r.loaded)


def test_run_distributed_ranks_see_the_sandbox(kwplug_plugins: PluginSandbox) -> None:
    # Other plugins installed in this environment (the example plugins in CI) stay hidden.
    kwplug_plugins.add(ScalerOff, name="scaler-off", distribution="kwplug-scaler-off")
    expected = [("kwplug-scaler-off", "scaler-off")]
    assert run_distributed(third_party_plugins, nproc=2, timeout=120) == [expected, expected]


def test_run_distributed_headline_names_the_rank_that_raised_first() -> None:
    with pytest.raises(DistributedRunError) as info:
        run_distributed(fail_on_rank_one, nproc=2, timeout=120)
    assert str(info.value).splitlines()[0] == (
        "test_testing_kit:fail_on_rank_one: rank 1 raised ValueError: rank one is unhappy"
    )


@attrs.define
class Subtle(KwargsHandler):
    """Mistakes that are easy to miss."""

    token: Any = attrs.field(factory=object, validator=attrs.validators.instance_of(object))
    scale: float = 1.0  # annotated, but the unannotated field below turns auto_attribs off
    size = attrs.field(default=1, validator=attrs.validators.instance_of(int))

    @hookimpl
    def autocast(self, device: str) -> None:  # the spec says device_type
        return None


def test_subtle_mistakes_are_explained() -> None:
    problems = conformance_problems(Subtle, accepts_any=["token"])
    assert problems[0] == (
        "annotated attribute 'scale' is not an attrs field (annotate every attrs.field() too, "
        "or mark it ClassVar)"
    )
    assert "\n" not in problems[1]
    assert problems[1].endswith("the specs take: autocast(device_type, mixed_precision)")
    assert any("field(s) ['token'] compare by identity" in p for p in problems), problems


def test_keep_installed_refuses_a_distribution_that_is_not_there(
    kwplug_plugins: PluginSandbox,
) -> None:
    with pytest.raises(ValueError, match="no kwplug plugin distribution named kwplug-nope"):
        kwplug_plugins.keep_installed("kwplug_nope")
    with (
        pytest.raises(ValueError, match="kwplug-nope"),
        PluginSandbox(keep_installed=["kwplug-nope"]),
    ):
        pass


def test_sandboxes_nest(kwplug_plugins: PluginSandbox) -> None:
    kwplug_plugins.add(ScalerOff, name="scaler-off", distribution="kwplug-scaler-off")
    with PluginSandbox() as inner:
        assert all(r.name != "scaler-off" for r in inner.records())
    assert any(r.name == "scaler-off" for r in kwplug_plugins.records())


@attrs.define
class SharedDefault(KwargsHandler):
    names: list[str] = attrs.field(
        default=[],
        validator=attrs.validators.instance_of(list),
    )

    @hookimpl
    def autocast(self) -> None:
        return None


def test_shared_mutable_default_is_reported() -> None:
    assert conformance_problems(SharedDefault) == [
        "field 'names' has a mutable default shared by every instance ([]); use "
        "attrs.field(factory=...)"
    ]


def return_a_lock() -> Any:
    import threading

    return threading.Lock()


def raise_with_a_note() -> None:
    error = KeyError("the real cause")
    if hasattr(error, "add_note"):  # Python >= 3.11: the last traceback line is the note
        error.add_note("(raised by hook 'wrap_model' of a plugin)")
    raise error


def test_run_distributed_names_unpicklable_results_and_keeps_notes_out_of_the_headline() -> None:
    with pytest.raises(DistributedRunError, match=r"rank \d raised TypeError: the return value"):
        run_distributed(return_a_lock, nproc=1, timeout=120)
    with pytest.raises(DistributedRunError) as info:
        run_distributed(raise_with_a_note, nproc=1, timeout=120)
    assert str(info.value).splitlines()[0].endswith("rank 0 raised KeyError: 'the real cause'")
    with pytest.raises(ValueError, match="functools.partial"):
        run_distributed(functools.partial(all_reduce_rank, 1))

"""ProfileKwargs: fields, validation, and real torch.profiler runs through Accelerator.profile()."""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from torch.profiler import ProfilerActivity
from torchrun import torchrun

import kwplug
from kwplug import ProfileKwargs
from kwplug.plugins import profile as profile_module

WORKERS = Path(__file__).parents[1] / "workers"

DEFAULTS = {
    "activities": None,
    "schedule_option": None,
    "on_trace_ready": None,
    "record_shapes": False,
    "profile_memory": False,
    "with_stack": False,
    "with_flops": False,
    "with_modules": False,
    "output_trace_dir": None,
}

CYCLES = {"wait": 1, "warmup": 1, "active": 2, "repeat": 2}


@pytest.fixture(autouse=True)
def _quiet_profiler() -> Iterator[None]:
    # torch warns that a cycling profiler drops earlier cycles' events; expected here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        warnings.filterwarnings("ignore", message=".*won't be using warmup.*")
        yield


@pytest.fixture
def accelerator() -> kwplug.Accelerator:
    return kwplug.Accelerator(cpu=True)


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this machine look like a CPU-only torch build, whatever it has."""
    monkeypatch.setattr(torch.profiler, "supported_activities", lambda: {ProfilerActivity.CPU})


def matmuls(steps: int = 1) -> torch.Tensor:
    a = torch.randn(5, 7)
    b = torch.randn(7, 3)
    out = a @ b
    for _ in range(steps - 1):
        out = a @ b
    return out


def op_names(prof: torch.profiler.profile) -> set[str]:
    return {event.key for event in prof.key_averages()}


def trace_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def load_trace(path: Path) -> dict[str, Any]:
    with open(path) as f:
        data = json.load(f)
    assert isinstance(data, dict) and "traceEvents" in data, path
    return data


def profiler_steps(path: Path) -> set[str]:
    return {
        str(e.get("name"))
        for e in load_trace(path)["traceEvents"]
        if str(e.get("name", "")).startswith("ProfilerStep#")
    }


# -- fields --------------------------------------------------------------------------------------


def test_signature_and_defaults() -> None:
    params = inspect.signature(ProfileKwargs).parameters
    assert list(params) == list(DEFAULTS)
    assert {name: p.default for name, p in params.items()} == DEFAULTS
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params.values())
    assert ProfileKwargs().to_dict() == DEFAULTS
    assert issubclass(ProfileKwargs, kwplug.KwargsHandler)
    assert kwplug.ProfileKwargs is ProfileKwargs


def test_registered_as_builtin_entry_point() -> None:
    records = {r.name: r for r in kwplug.discover()}
    assert records["profile"].handler_class is ProfileKwargs


def test_to_kwargs_only_changed_fields(tmp_path: Path) -> None:
    assert ProfileKwargs().to_kwargs() == {}
    assert ProfileKwargs(record_shapes=False, activities=None).to_kwargs() == {}
    handler = ProfileKwargs(
        record_shapes=True,
        with_flops=True,
        schedule_option={"wait": 1, "active": 2},
        output_trace_dir=tmp_path,
    )
    assert handler.to_kwargs() == {
        "schedule_option": {"wait": 1, "active": 2},
        "record_shapes": True,
        "with_flops": True,
        "output_trace_dir": tmp_path,
    }
    # Field definition order, whatever the keyword order.
    assert list(handler.to_kwargs()) == ["schedule_option", "record_shapes", "with_flops",
                                         "output_trace_dir"]  # fmt: skip
    handler.record_shapes = False
    assert "record_shapes" not in handler.to_kwargs()


def test_activities_normalised(cpu_only: None) -> None:
    # Kept as given (Accelerate's field); normalised only when the profiler is built.
    assert ProfileKwargs(activities=["CPU", " cpu"]).activities == ["CPU", " cpu"]
    assert ProfileKwargs(activities=["CPU", " cpu"]).resolved_activities() == [ProfilerActivity.CPU]
    assert ProfileKwargs(activities=("cpu",)).activities == ("cpu",)
    assert ProfileKwargs(activities=[ProfilerActivity.CPU]).activities == [ProfilerActivity.CPU]
    assert ProfileKwargs(activities=["cpu"]).to_kwargs() == {"activities": ["cpu"]}


def test_schedule_option_is_copied() -> None:
    options = {"wait": 1, "warmup": 1, "active": 2}
    handler = ProfileKwargs(schedule_option=options)
    options["active"] = 0
    assert handler.schedule_option == {"wait": 1, "warmup": 1, "active": 2}
    assert handler.schedule_option is not options


def test_equality_and_values() -> None:
    assert ProfileKwargs() == ProfileKwargs()
    assert ProfileKwargs(with_stack=True) != ProfileKwargs()


# -- validation ----------------------------------------------------------------------------------

BAD_VALUES: list[tuple[str, Any, type[Exception], list[str]]] = [
    ("activities", "cpu", TypeError, ["pass a list", "['cpu']"]),
    ("activities", ProfilerActivity.CPU, TypeError, ["pass a list", "['cpu']"]),
    ("activities", {"cpu"}, TypeError, ["list/tuple", "'cuda'"]),
    ("activities", 0, TypeError, ["list/tuple"]),
    ("activities", [1], TypeError, ["'cpu'", "'hpu'"]),
    ("activities", [None], TypeError, ["activity names"]),
    ("activities", [], ValueError, ["at least one", "None"]),
    ("activities", ["gpu"], ValueError, ["'gpu'", "'cpu', 'cuda', 'xpu', 'mtia', 'hpu'"]),
    ("activities", ["cpu", "tpu"], ValueError, ["'tpu'", "'cpu', 'cuda', 'xpu', 'mtia', 'hpu'"]),
    ("activities", [ProfilerActivity.PrivateUse1], ValueError, ["'privateuse1'", "accepted"]),
    ("schedule_option", [("active", 1)], TypeError, ["dict", "'wait'", "'skip_first'"]),
    ("schedule_option", 3, TypeError, ["dict", "torch.profiler.schedule"]),
    (
        "schedule_option",
        {"active": 1, "bogus": 1},
        ValueError,
        ["'bogus'", "'wait', 'warmup', 'active', 'repeat', 'skip_first'"],
    ),
    ("schedule_option", {1: 1, "active": 1}, ValueError, ["1", "accepted"]),
    ("schedule_option", {"wait": 1, "warmup": 1}, ValueError, ["'active'", ">= 1"]),
    ("schedule_option", {}, ValueError, ["'active'"]),
    ("schedule_option", {"active": 0}, ValueError, ["'active'", ">= 1", "0"]),
    ("schedule_option", {"active": 1, "wait": -1}, ValueError, ["'wait'", ">= 0"]),
    ("schedule_option", {"active": 1, "repeat": -2}, ValueError, ["'repeat'", ">= 0"]),
    ("schedule_option", {"active": 1, "skip_first": -1}, ValueError, ["'skip_first'", ">= 0"]),
    ("schedule_option", {"active": 1.0}, TypeError, ["'active'", "int", "float"]),
    ("schedule_option", {"active": True}, TypeError, ["'active'", "int", "bool"]),
    ("schedule_option", {"active": 1, "warmup": "1"}, TypeError, ["'warmup'", "int"]),
    ("on_trace_ready", 3, TypeError, ["callable"]),
    ("on_trace_ready", "handler", TypeError, ["callable"]),
    ("output_trace_dir", 3, TypeError, ["str", "os.PathLike"]),
    ("output_trace_dir", b"traces", TypeError, ["str", "os.PathLike"]),
    ("output_trace_dir", "", ValueError, ["non-empty"]),
] + [
    (name, value, TypeError, ["True or False"])
    for name in ("record_shapes", "profile_memory", "with_stack", "with_flops", "with_modules")
    for value in (1, 0, None, "yes")
]


def _ids(case: tuple[str, Any, type[Exception], list[str]]) -> str:
    return f"{case[0]}={case[1]!r}"


@pytest.mark.parametrize("case", BAD_VALUES, ids=_ids)
def test_bad_value_at_construction(case: tuple[str, Any, type[Exception], list[str]]) -> None:
    name, value, error, fragments = case
    with pytest.raises(error) as info:
        ProfileKwargs(**{name: value})
    message = str(info.value)
    assert f"'{name}" in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("case", BAD_VALUES, ids=_ids)
def test_bad_value_on_assignment(case: tuple[str, Any, type[Exception], list[str]]) -> None:
    name, value, error, _ = case
    handler = ProfileKwargs()
    with pytest.raises(error, match=f"'{name}"):
        setattr(handler, name, value)
    assert getattr(handler, name) == DEFAULTS[name]  # unchanged


def test_unavailable_activity_names_available_ones(cpu_only: None) -> None:
    for name in ("cuda", "xpu", "mtia", "hpu"):
        with pytest.raises(ValueError, match="not available") as info:
            ProfileKwargs(activities=["cpu", name])
        assert f"'{name}'" in str(info.value)
        assert "available: 'cpu'" in str(info.value)
    handler = ProfileKwargs(activities=["cpu"])
    with pytest.raises(ValueError, match="available: 'cpu'"):
        handler.activities = ["cuda"]
    assert handler.activities == ["cpu"]


def test_unavailable_activity_on_this_machine() -> None:
    available = profile_module.available_activities()
    assert "cpu" in available
    missing = [n for n in profile_module.ACTIVITY_NAMES if n not in available]
    if not missing:
        pytest.skip("every activity is available here")
    with pytest.raises(ValueError, match="available"):
        ProfileKwargs(activities=missing[:1])


def test_good_values_accepted(tmp_path: Path) -> None:
    handler = ProfileKwargs(
        activities=["cpu"],
        schedule_option={"wait": 0, "warmup": 0, "active": 1, "repeat": 0, "skip_first": 0},
        on_trace_ready=print,
        record_shapes=True,
        profile_memory=True,
        with_stack=True,
        with_flops=True,
        with_modules=True,
        output_trace_dir=str(tmp_path),
    )
    handler.output_trace_dir = tmp_path
    handler.output_trace_dir = pathlib.PurePosixPath("rel/traces")
    handler.on_trace_ready = None
    handler.schedule_option = None
    handler.activities = None
    attrs.validate(handler)


def test_build_revalidates_in_place_changes() -> None:
    handler = ProfileKwargs(schedule_option={"active": 1})
    assert handler.schedule_option is not None
    handler.schedule_option["active"] = 0
    with pytest.raises(ValueError, match="'schedule_option\\['active'\\]' must be >= 1"):
        handler.build()


# -- build / make_profiler -----------------------------------------------------------------------


def test_build_maps_fields_to_torch_profile() -> None:
    prof = ProfileKwargs(
        record_shapes=True, profile_memory=True, with_stack=True, with_flops=True, with_modules=True
    ).build()
    assert isinstance(prof, torch.profiler.profile)
    assert prof.profiler is None  # built, not started
    assert prof.activities == {ProfilerActivity.CPU}
    assert (prof.record_shapes, prof.profile_memory, prof.with_stack) == (True, True, True)
    assert (prof.with_flops, prof.with_modules) == (True, True)
    plain = ProfileKwargs().build()
    assert (plain.record_shapes, plain.profile_memory, plain.with_stack) == (False, False, False)
    assert (plain.with_flops, plain.with_modules) == (False, False)
    assert plain.on_trace_ready is None


def test_default_activities_follow_device(monkeypatch: pytest.MonkeyPatch) -> None:
    handler = ProfileKwargs()
    monkeypatch.setattr(torch.profiler, "supported_activities", lambda: {ProfilerActivity.CPU})
    assert handler.resolved_activities("cpu") == [ProfilerActivity.CPU]
    # Device activity not available: CPU only.
    assert handler.resolved_activities("cuda") == [ProfilerActivity.CPU]
    assert handler.build("cuda").activities == {ProfilerActivity.CPU}
    monkeypatch.setattr(
        torch.profiler,
        "supported_activities",
        lambda: {ProfilerActivity.CPU, ProfilerActivity.CUDA, ProfilerActivity.XPU},
    )
    assert handler.resolved_activities("cuda") == [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    assert handler.resolved_activities("xpu") == [ProfilerActivity.CPU, ProfilerActivity.XPU]
    assert handler.resolved_activities("cpu") == [ProfilerActivity.CPU]
    assert handler.resolved_activities("mps") == [ProfilerActivity.CPU]  # no profiler activity
    assert handler.build("cuda").activities == {ProfilerActivity.CPU, ProfilerActivity.CUDA}
    # Explicit activities are used as given, whatever the device.
    assert ProfileKwargs(activities=["cpu"]).resolved_activities("cuda") == [ProfilerActivity.CPU]
    assert ProfileKwargs(activities=["cuda"]).build("cpu").activities == {ProfilerActivity.CUDA}


def test_make_profiler_hook_returns_built_profiler() -> None:
    prof = ProfileKwargs(record_shapes=True).make_profiler(device_type="cpu", rank=0)
    assert isinstance(prof, torch.profiler.profile)
    assert prof.record_shapes and prof.profiler is None


@pytest.mark.parametrize(("rank", "error"), [(-1, ValueError), ("0", TypeError), (True, TypeError)])
def test_build_rejects_bad_rank(rank: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="rank"):
        ProfileKwargs().build(rank=rank)


def test_build_creates_output_dir(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    handler = ProfileKwargs(output_trace_dir=target)
    assert not target.exists()  # construction has no side effect
    handler.build()
    assert target.is_dir()


# -- real profiling through Accelerator.profile() -------------------------------------------------


def test_profile_records_ops(accelerator: kwplug.Accelerator) -> None:
    with accelerator.profile(ProfileKwargs()) as prof:
        assert isinstance(prof, torch.profiler.profile)
        matmuls(3)
    assert "aten::mm" in op_names(prof)
    (mm,) = [e for e in prof.key_averages() if e.key == "aten::mm"]
    assert mm.count == 3


def test_default_handler_profiles(accelerator: kwplug.Accelerator) -> None:
    with accelerator.profile() as prof:
        matmuls()
    assert isinstance(prof, torch.profiler.profile)
    assert "aten::mm" in op_names(prof)
    assert not prof.record_shapes


def test_registered_handler_answers_profile(tmp_path: Path) -> None:
    accelerator = kwplug.Accelerator(
        cpu=True, kwargs_handlers=[ProfileKwargs(record_shapes=True, output_trace_dir=tmp_path)]
    )
    with accelerator.profile() as prof:
        matmuls()
    assert prof.record_shapes
    assert trace_files(tmp_path) == ["trace_rank0_step0.json"]
    # A per-call handler answers first.
    with accelerator.profile(ProfileKwargs()) as prof:
        matmuls()
    assert not prof.record_shapes
    assert trace_files(tmp_path) == ["trace_rank0_step0.json"]


def test_record_shapes_reaches_torch(accelerator: kwplug.Accelerator) -> None:
    with accelerator.profile(ProfileKwargs(record_shapes=True)) as prof:
        matmuls()
    shapes = [
        e.input_shapes for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::mm"
    ]
    assert [[5, 7], [7, 3]] in shapes
    with accelerator.profile(ProfileKwargs(record_shapes=False)) as prof:
        matmuls()
    shapes = [
        e.input_shapes for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::mm"
    ]
    assert [[5, 7], [7, 3]] not in shapes


def test_with_flops_and_profile_memory_reach_torch(accelerator: kwplug.Accelerator) -> None:
    with accelerator.profile(ProfileKwargs(with_flops=True, profile_memory=True)) as prof:
        matmuls()
    (mm,) = [e for e in prof.key_averages() if e.key == "aten::mm"]
    assert mm.flops == 2 * 5 * 7 * 3
    assert mm.cpu_memory_usage >= 5 * 3 * 4  # at least the float32 output, in bytes
    with accelerator.profile(ProfileKwargs()) as prof:
        matmuls()
    (mm,) = [e for e in prof.key_averages() if e.key == "aten::mm"]
    assert mm.flops == 0
    assert mm.cpu_memory_usage == 0


def test_no_schedule_writes_exactly_one_trace(
    accelerator: kwplug.Accelerator, tmp_path: Path
) -> None:
    calls: list[torch.profiler.profile] = []
    handler = ProfileKwargs(output_trace_dir=tmp_path, on_trace_ready=calls.append)
    with accelerator.profile(handler) as prof:
        matmuls()
        assert trace_files(tmp_path) == []
    assert calls == [prof]
    assert trace_files(tmp_path) == ["trace_rank0_step0.json"]
    names = {e.get("name") for e in load_trace(tmp_path / "trace_rank0_step0.json")["traceEvents"]}
    assert "aten::mm" in names
    # A second run into the same directory keeps the first file.
    with accelerator.profile(handler):
        matmuls()
    assert trace_files(tmp_path) == ["trace_rank0_step0.json", "trace_rank0_step0_1.json"]
    load_trace(tmp_path / "trace_rank0_step0_1.json")


def test_trace_file_names_carry_rank(tmp_path: Path) -> None:
    for rank in (3, 0):
        with ProfileKwargs(output_trace_dir=str(tmp_path)).build(rank=rank):
            matmuls()
    assert trace_files(tmp_path) == ["trace_rank0_step0.json", "trace_rank3_step0.json"]


def test_user_callback_runs_after_export(accelerator: kwplug.Accelerator, tmp_path: Path) -> None:
    seen: list[list[str]] = []
    handler = ProfileKwargs(
        output_trace_dir=tmp_path, on_trace_ready=lambda prof: seen.append(trace_files(tmp_path))
    )
    with accelerator.profile(handler):
        matmuls()
    assert seen == [["trace_rank0_step0.json"]]


def test_on_trace_ready_without_output_dir_is_passed_through(
    accelerator: kwplug.Accelerator,
) -> None:
    calls: list[int] = []

    def on_ready(prof: torch.profiler.profile) -> None:
        calls.append(prof.step_num)

    handler = ProfileKwargs(on_trace_ready=on_ready)
    assert handler.build().on_trace_ready is on_ready
    with accelerator.profile(handler):
        matmuls()
    assert calls == [0]


# wait=1, warmup=1, active=2, repeat=2: steps 0 wait, 1 warmup, 2-3 record (ready when step 4
# begins), 4 wait, 5 warmup, 6-7 record (ready at step 8), then nothing. Leaving the context
# while recording also makes a trace ready.
SCHEDULE_CASES = {
    0: [],
    1: [],
    2: [2],
    3: [3],
    4: [4],
    5: [4],
    6: [4, 6],
    8: [4, 8],
    12: [4, 8],
}


@pytest.mark.parametrize(("steps", "ready_at"), SCHEDULE_CASES.items())
def test_schedule_cycles(
    accelerator: kwplug.Accelerator, tmp_path: Path, steps: int, ready_at: list[int]
) -> None:
    calls: list[int] = []
    handler = ProfileKwargs(
        schedule_option=CYCLES,
        output_trace_dir=tmp_path,
        on_trace_ready=lambda prof: calls.append(prof.step_num),
    )
    with accelerator.profile(handler) as prof:
        for _ in range(steps):
            matmuls()
            prof.step()
    assert calls == ready_at
    assert trace_files(tmp_path) == sorted(f"trace_rank0_step{n}.json" for n in ready_at)
    for n in ready_at:
        load_trace(tmp_path / f"trace_rank0_step{n}.json")
    if steps == 8:  # each file holds its own cycle's recorded steps
        assert profiler_steps(tmp_path / "trace_rank0_step4.json") == {
            "ProfilerStep#2",
            "ProfilerStep#3",
        }
        assert profiler_steps(tmp_path / "trace_rank0_step8.json") == {
            "ProfilerStep#6",
            "ProfilerStep#7",
        }


def test_schedule_defaults_and_skip_first(accelerator: kwplug.Accelerator, tmp_path: Path) -> None:
    calls: list[int] = []
    handler = ProfileKwargs(
        schedule_option={"active": 1, "skip_first": 2},
        output_trace_dir=tmp_path,
        on_trace_ready=lambda prof: calls.append(prof.step_num),
    )
    with accelerator.profile(handler) as prof:
        for _ in range(5):
            matmuls()
            prof.step()
    # wait=warmup=0: after 2 skipped steps every step is a 1-step cycle. Step 4's trace is
    # ready when step 5 begins, and step 5's when the context is left: both at step_num 5,
    # so the second file gets a suffix instead of replacing the first.
    assert calls == [3, 4, 5, 5]
    assert trace_files(tmp_path) == [
        "trace_rank0_step3.json",
        "trace_rank0_step4.json",
        "trace_rank0_step5.json",
        "trace_rank0_step5_1.json",
    ]
    assert profiler_steps(tmp_path / "trace_rank0_step5.json") == {"ProfilerStep#4"}
    assert profiler_steps(tmp_path / "trace_rank0_step5_1.json") == {"ProfilerStep#5"}


@pytest.mark.parametrize("steps", [0, 1])
def test_exit_before_recording_step_writes_nothing(
    accelerator: kwplug.Accelerator, tmp_path: Path, steps: int
) -> None:
    # The known trap: exporting a trace the schedule never recorded must not crash.
    calls: list[torch.profiler.profile] = []
    handler = ProfileKwargs(
        schedule_option={"wait": 1, "warmup": 1, "active": 2},
        output_trace_dir=tmp_path / "traces",
        on_trace_ready=calls.append,
    )
    with accelerator.profile(handler) as prof:
        for _ in range(steps):
            matmuls()
            prof.step()
    assert calls == []
    assert (tmp_path / "traces").is_dir()
    assert trace_files(tmp_path / "traces") == []


def test_exception_inside_profile_propagates(
    accelerator: kwplug.Accelerator, tmp_path: Path
) -> None:
    with (
        pytest.raises(RuntimeError, match="boom"),
        accelerator.profile(ProfileKwargs(output_trace_dir=tmp_path)),
    ):
        matmuls()
        raise RuntimeError("boom")
    # The profiler still stopped and wrote its trace.
    assert trace_files(tmp_path) == ["trace_rank0_step0.json"]


# -- per rank under torchrun -----------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_two_ranks_write_distinct_traces(tmp_path: Path) -> None:
    out = tmp_path / "traces"
    result = torchrun(WORKERS / "profile_ranks.py", str(out), nproc=2, timeout=120)
    assert "rank 0 done" in result.stdout and "rank 1 done" in result.stdout
    assert trace_files(out) == ["auto", "trace_rank0_step0.json", "trace_rank1_step0.json"]
    assert trace_files(out / "auto") == ["trace_rank0_step0.json", "trace_rank1_step0.json"]
    contents = set()
    for name in ("trace_rank0_step0.json", "trace_rank1_step0.json"):
        data = load_trace(out / name)
        assert any(e.get("name") == "aten::mm" for e in data["traceEvents"]), name
        contents.add(json.dumps(data, sort_keys=True))
    assert len(contents) == 2
    assert os.path.getsize(out / "trace_rank0_step0.json") > 0

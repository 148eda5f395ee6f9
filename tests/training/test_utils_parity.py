"""kwplug.utils against accelerate.utils in one process: same names, same results."""

from __future__ import annotations

import ast
import collections
import dataclasses
import importlib
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kwplug.utils as ku
from kwplug.utils import operations, structures

accelerate_utils = pytest.importorskip("accelerate.utils")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def accelerate_state() -> Iterator[None]:
    """Accelerate's free functions create its PartialState singleton; drop it afterwards."""
    from accelerate.state import PartialState

    yield
    PartialState._reset_state()


# -- names ------------------------------------------------------------------------------------


def test_every_export_resolves_and_matches_its_module() -> None:
    for name, module_name in ku._EXPORTS.items():
        assert name in importlib.import_module(module_name).__all__, (name, module_name)
    assert ku.__all__ == sorted(ku._EXPORTS)
    for name in ku.__all__:
        assert getattr(ku, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = ku.nope
    assert "set_seed" in dir(ku)


#: Checks Accelerate 1.16 dropped from ``accelerate.utils`` and its modules (earlier 1.x had
#: them): kwplug keeps them, so that scripts written for those versions still import. (1.16
#: also stopped re-exporting six names at the top level; its submodules still have them.)
DROPPED_IN_ACCELERATE_1_16 = frozenset({"is_pippy_available", "is_weights_only_available"})


def _accelerate_at_least(version: str) -> bool:
    from importlib.metadata import version as installed

    from packaging.version import Version

    return Version(installed("accelerate")) >= Version(version)


def test_every_export_is_an_accelerate_utils_name() -> None:
    # In accelerate.utils itself, or in its module of the same name (structures: operations).
    def theirs(module: str) -> Any:
        tail = module.rsplit(".", 1)[-1].replace("structures", "operations")
        try:
            return importlib.import_module(f"accelerate.utils.{tail}")
        except ModuleNotFoundError:
            return None

    missing = {
        name
        for name in ku.__all__
        if not hasattr(accelerate_utils, name)
        and not (
            ku._EXPORTS[name].startswith("kwplug.utils.")
            and hasattr(theirs(ku._EXPORTS[name]), name)
        )
    }
    if _accelerate_at_least("1.16"):
        assert missing == DROPPED_IN_ACCELERATE_1_16  # each still exported, none stale
    else:
        assert missing == set()
    assert set(ku.__all__) >= DROPPED_IN_ACCELERATE_1_16


def test_accelerate_1_16_device_helpers_answer_as_accelerate() -> None:
    if not _accelerate_at_least("1.16"):
        pytest.skip("Accelerate < 1.16 has no device helpers")
    # not "hpu": other tests register a fake backend for it with torch, which kwplug then reports
    for device_type in (None, "cpu", "cuda", "xpu", "mps", "npu", "nope"):
        assert ku.get_distributed_backend(device_type) == accelerate_utils.get_distributed_backend(
            device_type
        ), device_type
    for check in (True, False):
        assert ku.get_torch_accelerator_backend(check) == (
            accelerate_utils.get_torch_accelerator_backend(check)
        )
    for device in (0, 3, "cpu", "npu", torch.device("cpu"), "cuda:1"):
        assert ku.normalize_device(device) == accelerate_utils.normalize_device(device), device

    class Module:  # a device module: (free, total) bytes of device i
        @staticmethod
        def mem_get_info(index: int) -> tuple[int, int]:
            return (1000 + index, 4000)

    assert ku.get_accelerator_free_memory(Module, 2) == 1002
    assert ku.get_accelerator_free_memory(Module, 2) == (
        accelerate_utils.get_accelerator_free_memory(Module, 2)
    )


def test_verbosity_is_kwplugs_library_level() -> None:
    import logging

    import kwplug.logging as kl

    library, child = logging.getLogger("kwplug"), logging.getLogger("kwplug.some.module")
    accelerate_logger = logging.getLogger("accelerate")  # Accelerate's, set as by Accelerate
    before, before_accelerate = library.level, accelerate_logger.level
    try:
        kl.set_verbosity("error")
        assert kl.get_verbosity() == logging.ERROR == child.getEffectiveLevel()
        assert logging.getLogger("accelerate.test_verbosity").getEffectiveLevel() == logging.ERROR
        kl.set_verbosity_debug()
        assert kl.get_verbosity() == logging.DEBUG
        kl.set_verbosity_info()
        assert kl.get_verbosity() == logging.INFO
        kl.set_verbosity_warning()
        assert kl.get_verbosity() == logging.WARNING
        kl.set_verbosity_error()
        assert kl.get_verbosity() == logging.ERROR
        kl.set_verbosity(logging.DEBUG)
        assert kl.get_verbosity() == logging.DEBUG
        assert logging.getLogger().level != logging.DEBUG or before == logging.DEBUG
        with pytest.raises(ValueError, match="DEBUG, INFO, WARNING, ERROR, CRITICAL"):
            kl.set_verbosity("loud")
        with pytest.raises(TypeError, match="verbosity must be"):
            kl.set_verbosity(True)
    finally:
        library.setLevel(before)
        accelerate_logger.setLevel(before_accelerate)


def test_the_handlers_are_kwplugs_own() -> None:
    import kwplug.plugins

    assert ku.DistributedDataParallelKwargs is kwplug.plugins.DistributedDataParallelKwargs
    assert ku.DDPCommunicationHookType is kwplug.plugins.DDPCommunicationHookType


def test_import_is_lazy_and_never_imports_accelerate_or_numpy() -> None:
    code = (
        "import sys, kwplug\n"
        "assert not any(m.startswith(('kwplug.utils', 'kwplug.local_sgd')) for m in sys.modules)\n"
        "import kwplug.utils, kwplug.local_sgd\n"
        "assert [m for m in sys.modules if m.startswith('kwplug.utils')] == ['kwplug.utils']\n"
        "kwplug.utils.set_seed, kwplug.utils.gather, kwplug.utils.DistributedType\n"
        "assert 'accelerate' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    # torch itself imports NumPy, so check kwplug's own module-level imports statically.
    for path in [*sorted((ROOT / "core" / "utils").glob("*.py")), ROOT / "core" / "local_sgd.py"]:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                modules = [*names, getattr(node, "module", None) or ""]
                assert not any(m.split(".")[0] in ("numpy", "accelerate") for m in modules), path


# -- configuration objects --------------------------------------------------------------------


def test_distributed_type_has_accelerates_members() -> None:
    theirs = accelerate_utils.DistributedType
    assert [(m.name, m.value) for m in ku.DistributedType] == [(m.name, m.value) for m in theirs]
    assert ku.DistributedType.MULTI_CPU == "MULTI_CPU" == theirs.MULTI_CPU
    from kwplug.utils.dataclasses import default_distributed_type

    assert default_distributed_type("cuda", 1) is ku.DistributedType.NO
    assert default_distributed_type("cpu", 2) is ku.DistributedType.MULTI_CPU
    assert default_distributed_type("cuda", 8) is ku.DistributedType.MULTI_GPU
    assert default_distributed_type("privateuseone", 2) is ku.DistributedType.MULTI_GPU
    with pytest.raises(ValueError, match="num_processes"):
        default_distributed_type("cpu", 0)


@pytest.mark.parametrize(
    "name", ["DataLoaderConfiguration", "ProjectConfiguration", "GradientAccumulationPlugin"]
)
def test_configuration_fields_and_defaults_match_accelerate(name: str) -> None:
    ours, theirs = getattr(ku, name)(), getattr(accelerate_utils, name)()
    their_fields = [f.name for f in dataclasses.fields(theirs)]
    assert _field_names(ours) == their_fields
    assert {f: getattr(ours, f) for f in their_fields} == dataclasses.asdict(theirs)


def _field_names(obj: Any) -> list[str]:
    import attrs

    return [f.name for f in attrs.fields(type(obj))]


def test_configurations_accept_positional_arguments_like_accelerate() -> None:
    args = (True, False, False, True, 7, True, False)
    theirs = dataclasses.asdict(accelerate_utils.DataLoaderConfiguration(*args))
    assert _as_dict(ku.DataLoaderConfiguration(*args)) == theirs


def _as_dict(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in _field_names(obj)}


@pytest.mark.parametrize(
    ("make", "error", "field"),
    [
        (lambda: ku.DataLoaderConfiguration(split_batches=1), TypeError, "split_batches"),
        (lambda: ku.DataLoaderConfiguration(even_batches="yes"), TypeError, "even_batches"),
        (lambda: ku.DataLoaderConfiguration(dispatch_batches=0), TypeError, "dispatch"),
        (lambda: ku.DataLoaderConfiguration(data_seed="7"), TypeError, "data_seed"),
        (lambda: ku.DataLoaderConfiguration(data_seed=2**64), ValueError, "data_seed"),
        (lambda: ku.DataLoaderConfiguration(non_blocking=None), TypeError, "non_blocking"),
        (lambda: ku.ProjectConfiguration(project_dir=3), TypeError, "project_dir"),
        (lambda: ku.ProjectConfiguration(total_limit=0), ValueError, "total_limit"),
        (lambda: ku.ProjectConfiguration(iteration=-1), ValueError, "iteration"),
        (lambda: ku.ProjectConfiguration(iteration=True), TypeError, "iteration"),
        (lambda: ku.ProjectConfiguration(save_on_each_node=1), TypeError, "save_on_each_node"),
        (lambda: ku.GradientAccumulationPlugin(num_steps=0), ValueError, "num_steps"),
        (lambda: ku.GradientAccumulationPlugin(sync_each_batch=1), TypeError, "sync_each"),
    ],
)
def test_invalid_configuration_values_name_the_field(
    make: Callable[[], Any], error: type[Exception], field: str
) -> None:
    with pytest.raises(error, match=field):
        make()


def test_configurations_validate_on_assignment() -> None:
    config = ku.DataLoaderConfiguration()
    with pytest.raises(TypeError, match="dispatch_batches"):
        config.dispatch_batches = 1  # type: ignore[assignment]
    config.dispatch_batches = True  # Accelerate's dispatching is supported
    project = ku.ProjectConfiguration()
    with pytest.raises(ValueError, match="total_limit"):
        project.total_limit = -2
    assert ku.DataLoaderConfiguration(use_stateful_dataloader=True).use_stateful_dataloader


def test_project_configuration_directories_follow_accelerate(tmp_path: Path) -> None:
    ours = ku.ProjectConfiguration(project_dir=tmp_path)
    theirs = accelerate_utils.ProjectConfiguration(project_dir=str(tmp_path))
    assert (ours.project_dir, ours.logging_dir) == (theirs.project_dir, theirs.logging_dir)
    ours.set_directories(tmp_path / "b")
    theirs.set_directories(str(tmp_path / "b"))
    assert (ours.project_dir, ours.logging_dir) == (theirs.project_dir, theirs.logging_dir)
    fixed = ku.ProjectConfiguration(project_dir="p", logging_dir=tmp_path / "logs")
    fixed.set_directories("q")
    assert (fixed.project_dir, fixed.logging_dir) == ("q", str(tmp_path / "logs"))


def test_gradient_accumulation_plugin_to_kwargs() -> None:
    plugin = ku.GradientAccumulationPlugin(num_steps=4, sync_with_dataloader=False)
    theirs = accelerate_utils.GradientAccumulationPlugin(num_steps=4, sync_with_dataloader=False)
    assert (
        plugin.to_kwargs()
        == theirs.to_kwargs()
        == {
            "num_steps": 4,
            "sync_with_dataloader": False,
        }
    )


# -- set_seed ---------------------------------------------------------------------------------


def _draw() -> tuple[Any, ...]:
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist(),
        torch.rand(3).tolist(),
        torch.randint(0, 1000, (4,)).tolist(),
    )


@pytest.mark.parametrize("seed", [0, 42, 2**32 - 1])
def test_set_seed_gives_accelerates_streams(seed: int) -> None:
    accelerate_utils.set_seed(seed)
    theirs = _draw()
    random.seed(seed + 1)  # something else in between
    torch.manual_seed(seed + 1)
    ku.set_seed(seed)
    assert _draw() == theirs


def test_set_seed_device_specific_adds_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    ku.set_seed(10, device_specific=True)
    ours = _draw()
    ku.set_seed(13)
    assert _draw() == ours


def test_set_seed_deterministic_and_validation() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    try:
        ku.set_seed(1, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)
    for bad, error in ((True, TypeError), (1.5, TypeError), (-1, ValueError), (2**32, ValueError)):
        with pytest.raises(error, match="seed"):
            ku.set_seed(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="deterministic"):
        ku.set_seed(1, deterministic=1)  # type: ignore[arg-type]


# -- collectives and nested data in one process -----------------------------------------------


Point = collections.namedtuple("Point", ["x", "y"])


def _nested() -> dict[str, Any]:
    return {
        "a": torch.arange(6.0).reshape(2, 3),
        "b": [torch.tensor(1.5), (torch.ones(2, dtype=torch.bfloat16), "label")],
        "p": Point(torch.zeros(1, dtype=torch.float16), torch.tensor([3, 4])),
    }


def _same(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs)
    if isinstance(ours, torch.Tensor):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    elif isinstance(ours, dict):
        assert ours.keys() == theirs.keys()
        for key in ours:
            _same(ours[key], theirs[key])
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs)
        for x, y in zip(ours, theirs, strict=True):
            _same(x, y)
    else:
        assert ours == theirs


@pytest.mark.usefixtures("accelerate_state")
def test_single_process_collectives_match_accelerate() -> None:
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": [torch.tensor(1.5)]}
    for name in ("gather", "pad_across_processes", "broadcast"):
        _same(getattr(ku, name)(tensors), getattr(accelerate_utils, name)(tensors))
    for reduction in ("mean", "sum", "max"):
        ours = ku.reduce(tensors, reduction=reduction)
        _same(ours, accelerate_utils.reduce(tensors, reduction=reduction))
        assert ours["a"] is not tensors["a"]  # a copy
    _same(ku.gather_object([1, "x"]), accelerate_utils.gather_object([1, "x"]))
    assert ku.broadcast_object_list([1, 2]) == accelerate_utils.broadcast_object_list([1, 2])
    with pytest.raises(ValueError, match="reduction"):
        ku.reduce(torch.ones(1), reduction="none")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Unsupported types \\(<class 'str'>\\)"):
        ku.pad_across_processes(["text"])


def test_nested_helpers_match_accelerate() -> None:
    data = _nested()
    for name in ("listify", "convert_to_fp32", "find_batch_size", "find_device"):
        _same(getattr(ku, name)(data), getattr(accelerate_utils, name)(data))
    rows = {"a": data["a"], "p": data["p"]}  # no 0-d tensor: those cannot be sliced
    _same(ku.slice_tensors(rows, slice(0, 1)), accelerate_utils.slice_tensors(rows, slice(0, 1)))
    _same(ku.send_to_device(data, "cpu"), accelerate_utils.send_to_device(data, "cpu"))
    skipped = ku.send_to_device({"x": torch.ones(1), "y": torch.ones(1)}, "meta", skip_keys="y")
    assert skipped["x"].device.type == "meta" and skipped["y"].device.type == "cpu"
    batches = [{"a": torch.ones(2, 3), "t": (torch.zeros(2),)} for _ in range(3)]
    _same(ku.concatenate(batches), accelerate_utils.concatenate(batches))
    assert ku.get_shape(data)["a"] == [2, 3]
    assert ku.ignorant_find_batch_size([]) is None and ku.is_namedtuple(Point(1, 2))
    doubled = ku.recursively_apply(lambda t: t * 2, data)
    _same(doubled, accelerate_utils.recursively_apply(lambda t: t * 2, data))
    assert isinstance(doubled["p"], Point) and doubled["b"][1][1] == "label"
    with pytest.raises(TypeError, match="<class 'str'>\\) passed to `<lambda>`"):
        structures.recursively_apply(lambda t: t, ["s"], error_on_other_type=True)


def test_gather_object_flattens_lists_and_keeps_other_objects() -> None:
    # One process: unchanged, as in Accelerate (the flattening happens across processes).
    assert operations.gather_object({"k": 1}) == {"k": 1}


# -- availability helpers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        n
        for n, module in ku._EXPORTS.items()
        if module == "kwplug.utils.imports" and n.startswith("is_") and "version" not in n
    ],
)
def test_availability_helpers_agree_with_accelerate(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCELERATE_ENABLE_RICH", "1")  # Accelerate's rich check also needs it
    theirs = getattr(importlib.import_module("accelerate.utils.imports"), name)
    assert getattr(ku, name)() == bool(theirs())


def test_version_helpers() -> None:
    assert ku.is_torch_version(">=", "2.4") and not ku.is_torch_version("<", "1.0")
    assert ku.is_torch_version("==", torch.__version__) == accelerate_utils.is_torch_version(
        "==", torch.__version__
    )
    assert ku.compare_versions("pytest", ">=", "8")
    with pytest.raises(ValueError, match="operation"):
        ku.is_torch_version("~=", "2.0")
    with pytest.raises(ValueError, match="check_is_tpu"):
        ku.is_torch_xla_available(check_is_tpu=True, check_is_gpu=True)


def test_patch_environment_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KWPLUG_T_OLD", "1")
    monkeypatch.delenv("KWPLUG_T_NEW", raising=False)
    with pytest.raises(KeyError), ku.patch_environment(kwplug_t_old=2, kwplug_t_new="x"):
        assert os.environ["KWPLUG_T_OLD"] == "2" and os.environ["KWPLUG_T_NEW"] == "x"
        raise KeyError
    assert os.environ["KWPLUG_T_OLD"] == "1" and "KWPLUG_T_NEW" not in os.environ
    assert ku.str_to_bool("Yes") == 1 and ku.str_to_bool("off") == 0
    with pytest.raises(ValueError, match="truth"):
        ku.str_to_bool("maybe")
    from kwplug.utils.environment import parse_flag_from_env

    assert parse_flag_from_env("KWPLUG_T_OLD") and not parse_flag_from_env("KWPLUG_T_NEW")


def test_accelerates_top_level_utils_names_are_at_kwplugs_top_level() -> None:
    import accelerate

    import kwplug

    utils_names = [n for n, module in kwplug._EXPORTS.items() if module == "kwplug.utils"]
    assert utils_names
    for name in utils_names:
        assert hasattr(accelerate, name)
        assert getattr(kwplug, name) is getattr(ku, name)
        assert name in kwplug.__all__

"""The ``accelerate.utils`` names Accelerate's own tests/test_utils.py imports (issue 28 item 3),
each compared with the installed Accelerate's on the same input."""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch

import kwplug.utils as ku
from kwplug.utils import operations

accelerate_utils = pytest.importorskip("accelerate.utils")


@pytest.fixture
def accelerate_state() -> Iterator[None]:
    """Accelerate's logging needs its PartialState singleton; drop it afterwards."""
    from accelerate.state import PartialState

    PartialState()
    yield
    PartialState._reset_state()


def test_the_test_files_imports_resolve() -> None:
    from kwplug.utils.operations import is_namedtuple

    for name in (
        "check_os_kernel",
        "convert_dict_to_env_variables",
        "convert_outputs_to_fp32",
        "has_offloaded_params",
        "pad_input_tensors",
    ):
        assert name in ku.__all__
        assert callable(getattr(ku, name))
    assert is_namedtuple is operations.is_namedtuple is ku.is_namedtuple


@pytest.mark.parametrize(
    ("batch_size", "num_processes", "shape"),
    [(3, 4, (3, 4, 4)), (5, 4, (5, 2)), (2, 2, (2, 3)), (11, 3, (11,)), (1, 4, (1, 2, 2))],
)
def test_pad_input_tensors_sizes_and_values_are_accelerates(
    batch_size: int, num_processes: int, shape: tuple[int, ...]
) -> None:
    batch = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    ours = ku.pad_input_tensors({"x": batch, "y": [batch]}, batch_size, num_processes)
    theirs = accelerate_utils.pad_input_tensors(
        {"x": batch, "y": [batch]}, batch_size, num_processes
    )
    assert ours["x"].shape == theirs["x"].shape
    torch.testing.assert_close(ours["x"], theirs["x"])
    torch.testing.assert_close(ours["y"][0], theirs["y"][0])
    torch.testing.assert_close(ours["x"][:batch_size], batch)
    with pytest.raises(TypeError):
        ku.pad_input_tensors("text", batch_size, num_processes)


class _Half(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        return x.half(), {"b": x.bfloat16(), "i": x.long()}


def test_convert_outputs_to_fp32_converts_and_pickles() -> None:
    model = _Half()
    model.forward = ku.convert_outputs_to_fp32(model.forward)  # type: ignore[method-assign]
    x = torch.randn(2, 3)
    first, rest = model(x)
    assert (first.dtype, rest["b"].dtype, rest["i"].dtype) == (
        torch.float32,
        torch.float32,
        torch.int64,
    )
    assert model.forward.__name__ == "forward"
    # Accelerate's refuses to pickle; kwplug's pickles, and the copy still converts.
    copy = pickle.loads(pickle.dumps(model))
    assert copy(x)[0].dtype == torch.float32


def test_convert_dict_to_env_variables_is_accelerates(caplog: pytest.LogCaptureFixture) -> None:
    env = {"ACCELERATE_DEBUG_MODE": "1", "BAD_ENV_NAME": "<mything", "OTHER_ENV": "2", "E": ""}
    name = "accelerate.utils.environment"  # Accelerate's logger, its tests' assertLogs target
    with caplog.at_level(logging.WARNING, logger=name):
        ours = ku.convert_dict_to_env_variables(env)
        warned = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
        caplog.clear()
        theirs = accelerate_utils.convert_dict_to_env_variables(env)
        assert warned == [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert ours == theirs == ["ACCELERATE_DEBUG_MODE=1\n", "OTHER_ENV=2\n"]
    assert len(warned) == 2 and warned[0][0] == name and "BAD_ENV_NAME" in warned[0][2]


@pytest.mark.parametrize(
    ("system", "release", "warns"),
    [
        ("Linux", "5.4.0-35-generic", True),
        ("Linux", "5.15.0-35-generic", False),
        ("Darwin", "5.4.0-35-generic", False),
        ("Linux", "weird", False),
        ("Linux", "4.19.2", True),
    ],
)
def test_check_os_kernel_warns_as_accelerate(
    system: str,
    release: str,
    warns: bool,
    caplog: pytest.LogCaptureFixture,
    accelerate_state: None,
) -> None:
    uname = mock.Mock(system=system, release=release)
    with caplog.at_level(logging.WARNING), mock.patch("platform.uname", return_value=uname):
        ku.check_os_kernel()
        accelerate_utils.check_os_kernel()
    ours = [r for r in caplog.records if r.name.startswith("kwplug")]
    theirs = [r for r in caplog.records if r.name.startswith("accelerate")]
    assert len(ours) == len(theirs) == int(warns)
    if warns:
        assert ours[0].levelname == "WARNING"
        assert ours[0].getMessage().endswith(theirs[0].getMessage())


def test_has_offloaded_params_sees_only_an_offloading_align_devices_hook() -> None:
    from accelerate.hooks import attach_align_device_hook, remove_hook_from_module

    model = torch.nn.Linear(2, 2)
    assert ku.has_offloaded_params(model) is False
    attach_align_device_hook(model, offload=False)
    assert ku.has_offloaded_params(model) is accelerate_utils.has_offloaded_params(model) is False
    remove_hook_from_module(model)
    attach_align_device_hook(model, offload=True)
    assert ku.has_offloaded_params(model) is accelerate_utils.has_offloaded_params(model) is True


def test_recursively_apply_refuses_with_accelerates_message() -> None:
    with pytest.raises(TypeError) as ours:
        ku.recursively_apply(torch.tensor, (torch.tensor(1), 1), error_on_other_type=True)
    with pytest.raises(TypeError) as theirs:
        accelerate_utils.recursively_apply(
            torch.tensor, (torch.tensor(1), 1), error_on_other_type=True
        )
    assert str(ours.value) == str(theirs.value)
    assert "Unsupported types (<class 'int'>) passed to `tensor`" in str(ours.value)

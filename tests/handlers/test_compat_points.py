"""Issue 11's open compatibility points with Accelerate's handlers, each compared with
Accelerate's own dataclass where that is meaningful."""

from __future__ import annotations

from datetime import timedelta

import accelerate.utils as acc
import pytest

from kwplug.plugins import DistributedDataParallelKwargs, InitProcessGroupKwargs, ProfileKwargs


def test_backend_none_is_accepted_and_passed_on() -> None:
    handler = InitProcessGroupKwargs(backend=None)
    assert handler.backend is None
    assert handler.resolved_backend("cpu") is None  # torch picks per device
    assert handler.timeout == timedelta(seconds=1800)
    assert handler.to_kwargs() == {"backend": None}  # the resolved timeout is left to torch
    with pytest.raises(TypeError, match="None or a backend name"):
        InitProcessGroupKwargs(backend=3)  # type: ignore[arg-type]


def test_backend_none_initialises_torch_with_backend_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, object] = {}
    monkeypatch.setattr(
        "torch.distributed.init_process_group", lambda **kwargs: seen.update(kwargs)
    )
    assert InitProcessGroupKwargs(backend=None).init_process_group("cpu", 2, 0) is True
    assert seen["backend"] is None


def test_profile_activities_stay_the_users_list() -> None:
    given = ["cpu"]
    handler = ProfileKwargs(activities=given)
    assert handler.activities == given == acc.ProfileKwargs(activities=["cpu"]).activities
    assert isinstance(handler.activities, list)


@pytest.mark.parametrize("seconds", [600, 1800, 5])
def test_to_kwargs_keeps_a_given_timeout(seconds: int) -> None:
    timeout = timedelta(seconds=seconds)
    ours = InitProcessGroupKwargs(backend="gloo", timeout=timeout).to_kwargs()
    assert ours == {"backend": "gloo", "timeout": timeout}
    if seconds != 600:  # Accelerate itself drops a timeout equal to nccl's default
        assert ours == acc.InitProcessGroupKwargs(backend="gloo", timeout=timeout).to_kwargs()


def test_to_kwargs_leaves_out_a_resolved_timeout() -> None:
    assert InitProcessGroupKwargs(backend="gloo").to_kwargs() == {"backend": "gloo"}
    assert InitProcessGroupKwargs().to_kwargs() == {}


@pytest.mark.parametrize(
    "options",
    [
        {"start_powerSGD_iter": 1},
        {"start_powerSGD_iter": 1, "warm_start": False},
        {"start_powerSGD_iter": 1, "use_error_feedback": False},
    ],
)
def test_power_sgd_start_iter_refused_at_construction(options: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"start_powerSGD_iter.*must be > 1"):
        DistributedDataParallelKwargs(comm_hook="power_sgd", comm_state_option=options)


def test_power_sgd_start_iter_1_without_feedback_and_warm_start_is_fine() -> None:
    options = {"start_powerSGD_iter": 1, "use_error_feedback": False, "warm_start": False}
    handler = DistributedDataParallelKwargs(comm_hook="power_sgd", comm_state_option=options)
    assert handler.comm_state_option == options
    DistributedDataParallelKwargs(
        comm_hook="power_sgd", comm_state_option={"start_powerSGD_iter": 2}
    )

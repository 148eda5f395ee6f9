"""kwplug.utils.memory against accelerate.utils: the batch-size search and memory release."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch

import kwplug.utils as ku
from kwplug.utils import memory

accelerate_utils = pytest.importorskip("accelerate.utils")


# -- find_executable_batch_size ---------------------------------------------------------------


def _oom_above(limit: int, kind: str) -> Callable[..., Any]:
    """A train function that runs out of memory above ``limit``, the way torch reports it."""
    tried: list[int] = []

    def train(batch_size: int, scale: int = 1) -> tuple[int, list[int]]:
        tried.append(batch_size)
        if batch_size > limit:
            if kind == "cpu":
                torch.empty(2**45, dtype=torch.uint8)  # DefaultCPUAllocator: can't allocate
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size * scale, tried

    return train


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
@pytest.mark.parametrize(("start", "limit"), [(128, 40), (64, 64), (100, 1), (7, 0)])
def test_batch_size_search_matches_accelerate(
    kind: str, start: int, limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both libraries collect garbage after each out-of-memory error; in a test process that
    # holds torch and hundreds of tests' objects that is ~0.1 s per try, and what is compared
    # here is the sizes tried, the result and the error, not the collector.
    monkeypatch.setattr(gc, "collect", lambda generation=2: 0)

    def run(decorator: Callable[..., Any]) -> Any:
        fn = decorator(_oom_above(limit, kind), starting_batch_size=start)
        try:
            return fn(scale=2)
        except RuntimeError as error:
            return str(error)

    assert run(ku.find_executable_batch_size) == run(accelerate_utils.find_executable_batch_size)


def test_batch_size_search_as_decorator_with_arguments_and_kept_between_calls() -> None:
    tried: list[int] = []

    @ku.find_executable_batch_size(starting_batch_size=16)
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 10:
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return batch_size

    assert train() == 10 and tried == [16, 14, 12, 10]
    assert train() == 10 and tried[-1] == 10 and len(tried) == 5  # starts from the size found
    assert train.__name__ == "train"


def test_batch_size_search_custom_reduction_halves() -> None:
    sizes = iter([64, 32, 16])
    fn = ku.find_executable_batch_size(
        _oom_above(20, "cpu"), starting_batch_size=128, reduce_batch_size_fn=lambda: next(sizes)
    )
    assert fn() == (16, [128, 64, 32, 16])
    # kwplug keeps reduce_batch_size_fn in the decorator-with-arguments form too.
    halves = ku.find_executable_batch_size(
        starting_batch_size=8, reduce_batch_size_fn=iter([4, 2, 1]).__next__
    )
    assert halves(_oom_above(1, "cuda"))()[0] == 1


def test_batch_size_search_reaches_zero_and_other_errors_propagate() -> None:
    never = ku.find_executable_batch_size(_oom_above(-1, "cpu"), starting_batch_size=4)
    with pytest.raises(RuntimeError, match=r"^No executable batch size found, reached zero\.$"):
        never()

    @ku.find_executable_batch_size(starting_batch_size=4)
    def broken(batch_size: int) -> None:
        raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match="something else"):
        broken()
    with pytest.raises(ValueError, match="starting_batch_size"):
        ku.find_executable_batch_size(starting_batch_size=-1)


def test_batch_size_passed_by_the_caller_is_a_type_error_as_in_accelerate() -> None:
    def train(batch_size: int, model: str) -> str:
        return model

    for decorate in (ku.find_executable_batch_size, accelerate_utils.find_executable_batch_size):
        wrapped = decorate(train, starting_batch_size=8)
        assert wrapped("m") == "m"
        with pytest.raises(TypeError, match="Batch size was passed into `train`.*train\\(model="):
            wrapped(8, "m")

    def varargs(batch_size: int, *rest: Any) -> int:
        return len(rest)

    # Accelerate refuses this valid call; kwplug counts only the positional parameters.
    assert ku.find_executable_batch_size(varargs, starting_batch_size=2)(1, 2, 3) == 3


def test_should_reduce_batch_size_messages() -> None:
    yes = [
        torch.OutOfMemoryError("anything"),
        RuntimeError("CUDA out of memory. Tried to allocate 8.00 GiB"),
        RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried"),
        RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes."),
        RuntimeError("XPU out of memory. Tried to allocate"),
        RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"),
        RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED."),
    ]
    no = [ValueError("out of memory"), RuntimeError("shape mismatch"), KeyboardInterrupt()]
    assert [memory.should_reduce_batch_size(e) for e in yes] == [True] * len(yes)
    assert [memory.should_reduce_batch_size(e) for e in no] == [False] * len(no)
    a, b = ku.release_memory(torch.ones(3), torch.ones(3))
    assert a is None and b is None


def test_clear_device_cache_empties_only_an_initialised_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("cuda"))
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: calls.append("accelerator"))
    ku.clear_device_cache()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    ku.clear_device_cache()  # CUDA not initialised: nothing cached, and it stays uninitialised
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("xpu"))
    ku.clear_device_cache(garbage_collection=True)
    assert calls == ["cuda", "accelerator"]

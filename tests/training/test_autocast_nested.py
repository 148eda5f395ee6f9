"""Issue 20: a prepared model's mixed-precision forward inside ``accelerator.autocast()`` does
not build a second ``torch.autocast`` (only the nesting count moves), with the same results,
the same autocast state afterwards and the same cache clearing as entering it again."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kwplug

X = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _state() -> tuple[Any, ...]:
    nesting = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return (
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_cache_enabled(),
        nesting,
    )


def _bf16() -> kwplug.Accelerator:
    return kwplug.Accelerator(mixed_precision="bf16", cpu=True)


def test_nested_forward_equals_entering_autocast_again() -> None:
    acc = _bf16()
    model = acc.prepare(_net())
    reference = _net()
    with acc.autocast():
        before = _state()
        out = model(X)
        assert _state() == before
        out.sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = reference(X)
        expected.float().sum().backward()
    assert out.dtype == torch.float32
    assert torch.equal(out, expected.float())
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad)
    assert not _state()[0]
    assert _state()[3] == 0


@pytest.mark.parametrize(
    "outer",
    [
        {"dtype": torch.float16},
        {"dtype": torch.bfloat16, "enabled": False},
        {"dtype": torch.bfloat16, "cache_enabled": False},
    ],
)
def test_a_different_region_still_enters_the_context(outer: dict[str, Any]) -> None:
    acc = _bf16()
    model = acc.prepare(torch.nn.Linear(4, 2))
    inner = []
    original = model.forward.__wrapped__

    def probe(x: torch.Tensor) -> torch.Tensor:
        inner.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return original(x)

    model.forward.__wrapped__ = probe
    with torch.autocast("cpu", **outer):
        before = _state()
        model(X)
        assert _state() == before
    assert inner == [(True, torch.bfloat16)]


def test_state_leaked_by_the_forward_is_restored_and_errors_unwind() -> None:
    acc = _bf16()
    model = acc.prepare(torch.nn.Linear(4, 2))
    original = model.forward.__wrapped__

    def leaky(x: torch.Tensor) -> torch.Tensor:
        torch.set_autocast_enabled("cpu", False)
        torch.set_autocast_cache_enabled(False)
        return original(x)

    model.forward.__wrapped__ = leaky
    with acc.autocast():
        before = _state()
        model(X)
        assert _state() == before

    def broken(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    model.forward.__wrapped__ = broken
    with acc.autocast():
        before = _state()
        with pytest.raises(ValueError, match="boom"):
            model(X)
        assert _state() == before


def test_the_cache_is_cleared_when_the_nesting_drops_to_zero() -> None:
    # Autocast switched on by hand (no region): the forward is the outermost context.
    acc = _bf16()
    model = acc.prepare(torch.nn.Linear(4, 2))
    torch.set_autocast_enabled("cpu", True)
    torch.set_autocast_dtype("cpu", torch.bfloat16)
    try:
        cleared = []
        real = torch.clear_autocast_cache
        torch.clear_autocast_cache = lambda: (cleared.append(1), real())[1]  # type: ignore[assignment]
        try:
            model(X)
        finally:
            torch.clear_autocast_cache = real
        assert cleared == [1]
        assert _state()[:2] == (True, torch.bfloat16)
    finally:
        torch.set_autocast_enabled("cpu", False)


def test_a_replaced_factory_is_entered() -> None:
    acc = _bf16()
    model = acc.prepare(torch.nn.Linear(4, 2))
    entered = []

    class Context:
        def __enter__(self) -> None:
            entered.append(1)

        def __exit__(self, *exc: object) -> None:
            return None

    model.forward.autocast = Context
    with acc.autocast():
        model(X)
    assert entered == [1]

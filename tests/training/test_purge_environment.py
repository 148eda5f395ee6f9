"""``kwplug.utils.purge_accelerate_environment``: the decorated function or test class leaves
the ``ACCELERATE_*`` (and ``KWPLUG_*``) variables as it found them, as Accelerate's does."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from kwplug.utils import purge_accelerate_environment


def _changes_environment() -> str:
    os.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"  # new: removed afterwards
    os.environ["ACCELERATE_LOG_LEVEL"] = "DEBUG"  # changed: restored afterwards
    del os.environ["ACCELERATE_USE_CPU"]  # removed: restored afterwards
    os.environ["OTHER_VARIABLE"] = "kept"  # not Accelerate's: left as set
    return "done"


def _environment_after(decorator: Callable[[Any], Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "INFO")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.delenv("OTHER_VARIABLE", raising=False)
    result = decorator(_changes_environment)()
    names = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_LOG_LEVEL", "ACCELERATE_USE_CPU")
    after = {name: os.environ.get(name) for name in (*names, "OTHER_VARIABLE")}
    monkeypatch.delenv("OTHER_VARIABLE")
    return result, after


def test_function_matches_accelerate(monkeypatch: pytest.MonkeyPatch) -> None:
    utils = pytest.importorskip("accelerate.utils")
    ours = _environment_after(purge_accelerate_environment, monkeypatch)
    theirs = _environment_after(utils.purge_accelerate_environment, monkeypatch)
    # The same, but for a variable the function deleted: kwplug restores it too (Accelerate
    # only restores the variables still set when the function returns).
    assert theirs[1].pop("ACCELERATE_USE_CPU") is None
    assert ours[1].pop("ACCELERATE_USE_CPU") == "1"
    assert ours == theirs
    assert ours[1] == {
        "ACCELERATE_MIXED_PRECISION": None,
        "ACCELERATE_LOG_LEVEL": "INFO",
        "OTHER_VARIABLE": "kept",
    }


def test_class_and_subclass_test_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELERATE_X", raising=False)
    monkeypatch.delenv("KWPLUG_X", raising=False)

    @purge_accelerate_environment
    class Base:
        def test_sets(self) -> None:
            os.environ["ACCELERATE_X"] = "1"
            os.environ["KWPLUG_X"] = "1"

        def helper(self) -> None:
            os.environ["ACCELERATE_X"] = "helper"

    class Child(Base):
        def test_child(self) -> None:
            os.environ["ACCELERATE_X"] = "2"

    for method in (Base().test_sets, Child().test_child, Child().test_sets):
        method()
        assert "ACCELERATE_X" not in os.environ and "KWPLUG_X" not in os.environ
    Base().helper()  # not a test method: not wrapped
    assert os.environ.pop("ACCELERATE_X") == "helper"


def test_restores_when_the_function_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELERATE_Y", raising=False)

    @purge_accelerate_environment
    def fails() -> None:
        os.environ["ACCELERATE_Y"] = "1"
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fails()
    assert "ACCELERATE_Y" not in os.environ

"""The per-process memos of an Accelerator's construction (issue 20 goal 4) give the answers a
fresh computation gives: loading controls follow the environment between calls, a bad value
raises every time, and the validators' fast path accepts and refuses what the full check does.
"""

from __future__ import annotations

import enum
import math

import attrs
import pytest

from kwplug._plugins._controls import ALLOW_ENV, STRICT_ENV, LoadControls
from kwplug.errors import PluginLoadError
from kwplug.plugins.ddp_comm_hooks import builtin_comm_hooks
from kwplug.validators import number


def test_controls_follow_the_environment_between_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STRICT_ENV, "1")
    assert LoadControls.from_env().strict is True
    monkeypatch.setenv(STRICT_ENV, "off")
    assert LoadControls.from_env().strict is False
    monkeypatch.setenv(ALLOW_ENV, "Some_Dist")
    assert LoadControls.from_env().allow == frozenset({"some-dist"})
    monkeypatch.delenv(ALLOW_ENV)
    assert LoadControls.from_env().allow is None
    monkeypatch.setenv(STRICT_ENV, "maybe")
    for _ in range(2):  # a refused value is never memoised as an answer
        with pytest.raises(PluginLoadError, match="maybe"):
            LoadControls.from_env()


def test_controls_from_a_given_mapping() -> None:
    assert LoadControls.from_env({"KWPLUG_DISABLE_PLUGIN_AUTOLOAD": "yes"}).builtins_only
    assert not LoadControls.from_env({}).builtins_only


class _Level(enum.IntEnum):
    TWO = 2


@attrs.define
class _Holder:
    count: int = attrs.field(default=1, validator=number(integer=True, ge=1))
    ratio: float = attrs.field(default=0.5, validator=number(gt=0, le=1))


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("count", True, TypeError),  # a bool is no int
        ("count", 2.0, TypeError),  # a float is no int
        ("count", 0, ValueError),
        ("ratio", math.nan, ValueError),
        ("ratio", math.inf, ValueError),
        ("ratio", 1.5, ValueError),
        ("ratio", "0.5", TypeError),
    ],
)
def test_number_refuses(field: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=f"'{field}' must be"):
        _Holder(**{field: value})  # type: ignore[arg-type]


def test_number_accepts_int_subclasses_and_bounds() -> None:
    assert _Holder(count=_Level.TWO, ratio=1).count == 2
    assert _Holder(count=10**6, ratio=1.0).ratio == 1.0


def test_builtin_comm_hooks_are_a_new_dict_each_call() -> None:
    first, second = builtin_comm_hooks(), builtin_comm_hooks()
    assert first == second and first is not second
    first.pop("fp16")
    assert "fp16" in builtin_comm_hooks()


def test_is_int_refuses_bools_and_floats() -> None:
    from kwplug.validators import is_int

    assert is_int(0) and is_int(-3) and is_int(_Level.TWO)
    assert not any(is_int(v) for v in (True, False, 1.0, "1", None))


def test_the_core_checks_ints_through_validators() -> None:
    # The bool-is-not-int rule is written once (kwplug.validators): no hand-written copy.
    import pathlib
    import re

    core = pathlib.Path(__file__).parents[2] / "core"
    pattern = re.compile(r"isinstance\((\w[\w.]*), bool\) or not isinstance\(\1, int\)")
    found = [
        f"{path.relative_to(core)}:{number}"
        for path in sorted(core.rglob("*.py"))
        if path.name != "validators.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []

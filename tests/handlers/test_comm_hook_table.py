"""The table of built-in communication hooks, the shared option-schema checker, and lazy
imports of the built-in plugins."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from typing import Any

import attrs
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from kwplug.plugins import ddp_comm_hooks as hooks
from kwplug.plugins.ddp import DDPCommunicationHookType
from kwplug.validators import OptionSchema, number, optional_bool, strict_bool


def test_enum_and_name_lists_derive_from_the_table() -> None:
    names = tuple(row.name for row in hooks.BUILTIN_HOOKS)
    assert tuple(member.value for member in DDPCommunicationHookType) == ("no", *names)
    assert hooks.BUILTIN_HOOK_NAMES == names == tuple(hooks.builtin_comm_hooks())
    assert tuple(hooks.COMPRESSION_WRAPPERS) == ("fp16", "bf16")
    layout = {row.hook for row in hooks.BUILTIN_HOOKS if row.layout_dependent}
    assert layout == {
        powerSGD_hook.powerSGD_hook,
        hooks.batched_power_sgd_hook,
        hooks.power_sgd_inplace_hook,
    }
    assert layout < hooks.LAYOUT_DEPENDENT_HOOKS


def test_records_follow_the_rows() -> None:
    for row, record in zip(hooks.BUILTIN_HOOKS, hooks.builtin_comm_hooks().values(), strict=True):
        assert (record.name, record.hook, record.source) == (row.name, row.hook, "kwplug")
        assert record.make_state is row.make_state
        assert (record.check_options is None) == (row.options is None)
    with pytest.raises(ValueError, match="'rank'"):
        hooks.builtin_comm_hooks()["power_sgd"].check({"rank": 1})


def test_mean_allreduce_hook_delegates_to_torch_under_a_kwplug_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[Any, Any]] = []

    def fake(state: Any, bucket: Any) -> str:
        calls.append((state, bucket))
        return "torch's future"

    monkeypatch.setattr(default_hooks, "allreduce_hook", fake)
    assert hooks.mean_allreduce_hook("group", "bucket") == "torch's future"  # type: ignore[arg-type]
    assert calls == [("group", "bucket")]


class _Bucket:
    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def buffer(self) -> torch.Tensor:
        return self._tensor


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize(
    ("ours", "torch_name"),
    [
        (hooks.fp16_compress_allreduce_hook, "fp16_compress_hook"),
        (hooks.bf16_compress_allreduce_hook, "bf16_compress_hook"),
    ],
)
def test_low_precision_hooks_match_torch_bitwise(ours: Any, torch_name: str) -> None:
    # kwplug's own loop (a low-precision copy reused per bucket buffer), torch's arithmetic.
    grad = torch.randn(3001, generator=torch.Generator().manual_seed(0)) * 1e3
    grad[:5] = torch.tensor([1e-8, 7e4, -7e4, 1e-30, 3.3333])
    expected = getattr(default_hooks, torch_name)(None, _Bucket(grad.clone())).wait()
    buffer = grad.clone()
    for _ in range(2):  # the second call reuses the copy
        buffer.copy_(grad)
        assert torch.equal(ours(None, _Bucket(buffer)).wait(), expected)
    # DDP refuses these names without CUDA+NCCL (its check reads __name__).
    assert ours.__name__ not in {"bf16_compress_hook", "bf16_compress_wrapper_hook"}


def test_internal_modules_are_private_and_small() -> None:
    import importlib
    import pkgutil
    from pathlib import Path

    for info in pkgutil.iter_modules(hooks.__path__):
        assert info.name.startswith("_"), info.name
        module = importlib.import_module(f"{hooks.__name__}.{info.name}")
        assert module.__file__ is not None
        assert len(Path(module.__file__).read_text().splitlines()) <= 400, info.name


def _lazy_imports(code: str, **env: str) -> set[str]:
    code += "; import sys; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    ).stdout
    return {name for name in out.split() if name.startswith("kwplug.plugins.")}


def test_loading_one_builtin_does_not_import_the_others() -> None:
    loaded = _lazy_imports("import kwplug.plugins.autocast")
    assert "kwplug.plugins.autocast" in loaded
    assert not {"kwplug.plugins.ddp_comm_hooks", "kwplug.plugins.profile"} & loaded, loaded
    assert not {"kwplug.plugins.ddp", "kwplug.plugins.grad_scaler"} & loaded, loaded


def test_a_blocked_builtin_is_never_imported() -> None:
    code = "import kwplug; kwplug.Accelerator(cpu=True)"
    loaded = _lazy_imports(code, KWPLUG_BLOCK_PLUGINS="profile")
    assert "kwplug.plugins.autocast" in loaded
    assert "kwplug.plugins.profile" not in loaded, loaded


def test_plugins_package_reexports_lazily() -> None:
    import kwplug.plugins

    assert sorted(kwplug.plugins.__all__) == sorted(kwplug.plugins._EXPORTS)
    assert "ProfileKwargs" in dir(kwplug.plugins)
    assert kwplug.plugins.ProfileKwargs.__module__ == "kwplug.plugins.profile"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        kwplug.plugins.Nope  # noqa: B018


# -- kwplug.validators ------------------------------------------------------------------------


@attrs.define
class _Fields:
    count: int = attrs.field(default=1, validator=number(integer=True, ge=1))
    ratio: float = attrs.field(default=0.5, validator=number(gt=0, lt=1))
    flag: bool = attrs.field(default=True, validator=strict_bool)
    maybe: bool | None = attrs.field(default=None, validator=optional_bool)


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("count", True, TypeError, "'count' must be an int, got True of type bool"),
        ("count", 0, ValueError, "'count' must be >= 1, got 0"),
        ("ratio", 1, ValueError, "'ratio' must be > 0 and < 1, got 1"),
        ("ratio", math.nan, ValueError, "'ratio' must be finite, got nan"),
        ("flag", 1, TypeError, "'flag' must be True or False, got 1 of type int"),
        ("maybe", 0, TypeError, "'maybe' must be None, True or False"),
    ],
)
def test_validators_name_the_field(field: str, value: Any, error: type, message: str) -> None:
    with pytest.raises(error) as info:
        _Fields(**{field: value})
    assert message in str(info.value)


def test_validators_have_readable_reprs() -> None:
    assert repr(number(integer=True, ge=1)) == "<int validator >= 1>"
    assert repr(strict_bool) == "<strict bool validator>"
    assert repr(optional_bool) == "<optional strict bool validator>"


SCHEMA = OptionSchema(
    {"rate": number(gt=0, description="a rate > 0"), "on": strict_bool},
    name="opts",
    required=("rate",),
    defaults={"on": False},
)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"rate": 1, "bogus": 2, "1": 3}, ValueError, "unknown option(s) '1', 'bogus' in opts"),
        ({"on": True}, ValueError, "opts needs the option(s) 'rate'; accepted: 'rate', 'on'"),
        ({"rate": True}, TypeError, "opts['rate'] must be a rate > 0, got True of type bool"),
        ({"rate": 0}, ValueError, "opts['rate'] must be a rate > 0, got 0"),
        ({"rate": 1, "on": 0}, TypeError, "opts['on'] must be True or False"),
        ([("rate", 1)], TypeError, "opts must be a mapping"),
    ],
)
def test_option_schema_refuses(options: Any, error: type, message: str) -> None:
    with pytest.raises(error) as info:
        SCHEMA.check(options)
    assert message in str(info.value)


def test_option_schema_fills_defaults() -> None:
    options = {"rate": 2.5}
    assert SCHEMA.check(options) == {"rate": 2.5, "on": False}
    assert options == {"rate": 2.5}  # not modified
    assert SCHEMA.names == ("rate", "on")


def test_power_sgd_options_through_the_schema() -> None:
    with pytest.raises(TypeError, match=r"comm_state_option\['warm_start'\] must be True or False"):
        hooks.check_power_sgd_options({"warm_start": 1})
    hooks.check_power_sgd_options({"min_compression_rate": math.inf})  # as PowerSGDState allows

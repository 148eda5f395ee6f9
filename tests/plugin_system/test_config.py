"""Accelerator.from_config: TOML files and mappings keyed by entry-point name."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import attrs
import pytest
import torch

import kwplug
from kwplug import AutocastKwargs, GradScalerKwargs, InitProcessGroupKwargs
from kwplug.config import ConfigError, load_config
from kwplug.testing import PluginSandbox

GOOD = """
mixed_precision = "fp16"
cpu = true

[handlers.grad_scaler]
init_scale = 256.0
growth_interval = 10

[handlers.init_process_group]
backend = "gloo"
timeout = 120

[handlers.autocast]
cache_enabled = false
"""


def test_toml_file_builds_handlers_and_accelerator(tmp_path: Path) -> None:
    path = tmp_path / "kwplug.toml"
    path.write_text(GOOD)
    kwargs = load_config(path)
    assert kwargs["mixed_precision"] == "fp16" and kwargs["cpu"] is True
    assert kwargs["kwargs_handlers"] == [
        GradScalerKwargs(init_scale=256.0, growth_interval=10),
        InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=120)),
        AutocastKwargs(cache_enabled=False),
    ]
    accelerator = kwplug.Accelerator.from_config(path)
    assert accelerator.scaler is not None and accelerator.scaler.get_scale() == 256.0
    with accelerator.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.float16


def test_mapping_and_overrides() -> None:
    accelerator = kwplug.Accelerator.from_config(
        {"mixed_precision": "fp16", "handlers": {"grad_scaler": {"init_scale": 4.0}}},
        mixed_precision="bf16",
    )
    assert accelerator.mixed_precision == "bf16" and accelerator.scaler is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('mixed_precision = "bf16"\ncpu = = 1', r"kwplug.toml: malformed TOML: .*line 2"),
        (
            "[handlers.nope]\nx = 1",
            r"\[handlers.nope\]: no handler plugin named 'nope'; known: "
            r"autocast, ddp, dynamo, fsdp, (fsdp, )?grad_scaler, init_process_group, parallelism",
        ),
        (
            "[handlers.grad_scaler]\ninit_scal = 2.0",
            r"\[handlers.grad_scaler\]: unknown key 'init_scal' for GradScalerKwargs; accepted: "
            r"init_scale, growth_factor",
        ),
        (
            '[handlers.grad_scaler]\ninit_scale = "big"',
            r"\[handlers.grad_scaler\]: 'init_scale' must be a number",
        ),
        (
            "[handlers.init_process_group]\ntimeout = -3",
            r"\[handlers.init_process_group\]: 'timeout' must be at least 1 second",
        ),
        ("handlers = 3", r"'handlers' must be a table"),
        ("[handlers]\ngrad_scaler = 3", r"\[handlers.grad_scaler\] must be a table"),
        ("precision = 'bf16'", r"unknown key\(s\) precision; accepted: mixed_precision, cpu"),
        ('cpu = "yes"', r"kwplug.toml: 'cpu' must be true or false"),
        ('mixed_precision = "fp8"', r"kwplug.toml: 'mixed_precision' must be one of"),
    ],
)
def test_errors_name_file_table_and_key(
    tmp_path: Path, text: str, message: str, kwplug_plugins: PluginSandbox
) -> None:
    path = tmp_path / "kwplug.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="missing.toml: cannot read configuration"):
        kwplug.Accelerator.from_config(tmp_path / "missing.toml")


def test_a_blocked_plugin_is_named_as_blocked_not_unknown(
    kwplug_plugins: PluginSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KWPLUG_BLOCK_PLUGINS", "grad_scaler")
    with pytest.raises(
        ConfigError,
        match=r"\[handlers.grad_scaler\]: handler plugin 'grad_scaler' \(kwplug 0.1.0\) is "
        r"installed but not loaded \(blocked\)",
    ):
        load_config({"handlers": {"grad_scaler": {"init_scale": 2.0}}})


@attrs.define
class ChoiceKwargs(kwplug.KwargsHandler):
    """A third-party handler validated by attrs' own validators, as docs/writing-plugins.md
    suggests (``in_``, ``instance_of``)."""

    register_default = False

    dtype: str = attrs.field(
        default="float32", validator=attrs.validators.in_(("float32", "bfloat16"))
    )
    scale: float = attrs.field(default=1.0, validator=attrs.validators.instance_of(float))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"dtype": "int8"},
            r"\[handlers.choice\]: 'dtype' must be in \('float32', 'bfloat16'\) \(got 'int8'\)$",
        ),
        (
            {"scale": "x"},
            r"\[handlers.choice\]: 'scale' must be <class 'float'> "
            r"\(got 'x' that is a <class 'str'>\)\.?$",
        ),
    ],
)
def test_attrs_validator_errors_read_as_one_message(
    kwplug_plugins: PluginSandbox, options: dict[str, str], message: str
) -> None:
    # attrs' validators raise ValueError/TypeError(message, attribute, ...): str() of that is
    # the tuple's repr, which the error used to print whole (the Attribute's repr included).
    kwplug_plugins.add(ChoiceKwargs, name="choice", distribution="kwplug-choice")
    with pytest.raises(ConfigError, match=message) as info:
        load_config({"handlers": {"choice": options}})
    assert info.value.key == f"handlers.choice.{next(iter(options))}"

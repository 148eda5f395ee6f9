"""A plugin's requirement on kwplug (its declared API range) is checked before importing it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kwplug
from kwplug.cli import plugin_rows
from kwplug.errors import PluginLoadError, PluginLoadWarning
from kwplug.testing import PluginSandbox


@pytest.fixture
def bomb_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A plugin module that fails loudly if anything imports it."""
    (tmp_path / "kwplug_bomb_plugin.py").write_text("raise RuntimeError('imported!')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "kwplug_bomb_plugin"


def test_incompatible_plugin_is_reported_and_never_imported(
    kwplug_plugins: PluginSandbox, bomb_module: str
) -> None:
    with pytest.warns(PluginLoadWarning, match=r"requires kwplug<0\.1.*kwplug 0\.1\.0"):
        record = kwplug_plugins.add(
            bomb_module, name="old", distribution="kwplug-old", requires=["kwplug<0.1"]
        )
    assert record.status == "incompatible"
    assert bomb_module not in sys.modules
    row = next(r for r in plugin_rows(kwplug_plugins.records()) if r["name"] == "old")
    assert row["status"] == "incompatible"
    assert row["error"] == "requires kwplug<0.1, but kwplug 0.1.0 is installed"
    kwplug.Accelerator()  # everything else works


def test_strict_mode_makes_incompatibility_an_error(
    kwplug_plugins: PluginSandbox, bomb_module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.warns(PluginLoadWarning):
        kwplug_plugins.add(
            bomb_module, name="old", distribution="kwplug-old", requires=["kwplug>=9"]
        )
    monkeypatch.setenv("KWPLUG_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match="'old' \\(kwplug-old 0.0.0\\): requires kwplug>=9"):
        kwplug.Accelerator()


@pytest.mark.parametrize(
    "requires",
    [
        ["kwplug>=0.1,<0.2"],
        ["kwplug<0.1; extra == 'legacy'"],  # only behind an extra: not a requirement
        ["kwplug<0.1; python_version < '3'"],  # a marker false here
        ["torch>=2.4"],  # no requirement on kwplug at all
    ],
)
def test_compatible_or_unconditional_ranges_load(
    kwplug_plugins: PluginSandbox, requires: list[str]
) -> None:
    record = kwplug_plugins.add(
        "kwplug.plugins.ddp_comm_hooks", name="hooks", distribution="kwplug-ok", requires=requires
    )
    assert record.status == "loaded", record.error


def test_a_blocked_incompatible_plugin_is_just_blocked(
    kwplug_plugins: PluginSandbox, bomb_module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KWPLUG_BLOCK_PLUGINS", "old")
    record = kwplug_plugins.add(
        bomb_module, name="old", distribution="kwplug-old", requires=["kwplug<0.1"]
    )
    assert record.status == "blocked"


def test_packaging_is_imported_only_when_a_third_party_plugin_is_checked() -> None:
    # Built-ins are never range-checked, and no loading control is set: start-up skips
    # packaging (milliseconds per process).
    code = (
        "import sys, kwplug; kwplug.Accelerator(cpu=True); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'packaging'))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KWPLUG_")}
    env["KWPLUG_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == "[]"

"""Entry-point names that clash: with a built-in's, with another distribution's, and a
metadata folder named ``kwplug`` that declares the built-ins again (a checkout's
``kwplug.egg-info`` in the working folder of ``python -c``)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

import kwplug
from kwplug.testing import PluginSandbox


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on ``sys.path`` for plugin modules written by a test (removed afterwards)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("kwplug_clash_")]:
        del sys.modules[name]


def write(folder: Path, name: str, source: str) -> str:
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    return name


def test_a_foreign_kwplug_folder_declaring_the_builtins_again_does_not_crash(
    kwplug_plugins: PluginSandbox,
) -> None:
    # Found as "ValueError: Plugin name already registered: kwplug:wandb=<module
    # kwplug.plugins.wandb_tracker>" in `python -c` run from another checkout: its
    # kwplug.egg-info (distribution "kwplug", not this kwplug's files, so third-party)
    # declares the same entry points, naming the very modules and classes already loaded.
    for name, value in (
        ("wandb", "kwplug.plugins.wandb_tracker"),
        ("trackers", "kwplug.plugins.trackers"),
        ("ddp", "kwplug.plugins.ddp:DistributedDataParallelKwargs"),
    ):
        kwplug_plugins.add(value, name=name, distribution="kwplug", version="0.1.0")
    accelerator = kwplug.Accelerator(cpu=True)
    pm = accelerator.plugin_manager
    import kwplug.plugins.wandb_tracker as wandb_tracker

    # Registered once, by identity, as the built-in (not as a third-party default).
    assert [n for n, p in pm.list_name_plugin() if p is wandb_tracker] == ["kwplug:wandb"]
    assert not pm.is_third_party("kwplug:wandb")
    # Building a second Accelerator is as idempotent.
    kwplug.Accelerator(cpu=True)


def test_loading_a_builtin_by_hand_first_registers_it_once(kwplug_plugins: PluginSandbox) -> None:
    import importlib_metadata

    for ep in importlib_metadata.entry_points(group="kwplug.handlers"):
        if ep.value.startswith("kwplug."):
            ep.load()
    accelerator = kwplug.Accelerator(cpu=True)
    plugins = [p for _, p in accelerator.plugin_manager.list_name_plugin()]
    assert len(plugins) == len({id(p) for p in plugins})

"""Entry-point names that clash: with a built-in's, with another distribution's, and a
metadata folder named ``kwplug`` that declares the built-ins again (a checkout's
``kwplug.egg-info`` in the working folder of ``python -c``)."""

from __future__ import annotations

import sys
import textwrap
import warnings
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


def _clash_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "names clash" in str(w.message)]


def test_a_third_party_name_equal_to_a_builtin_is_reported_and_shadows_nothing(
    kwplug_plugins: PluginSandbox, modules: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = write(
        modules,
        "kwplug_clash_fsdp",
        """
        from typing import ClassVar

        import attrs
        import kwplug

        @attrs.define
        class OtherSharding(kwplug.KwargsHandler):
            register_default: ClassVar[bool] = True

            @kwplug.hookimpl
            def no_sync(self, model):
                return None
        """,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kwplug_plugins.add(
            f"{name}:OtherSharding", name="fsdp", distribution="kwplug-x", version="1.2"
        )
    (message,) = _clash_warnings(caught)
    assert "'fsdp'" in message
    assert "kwplug-x 1.2 (third-party)" in message and "(built-in)" in message
    records = [r for r in kwplug.discover() if r.name == "fsdp"]
    assert sorted((r.distribution, r.status) for r in records) == [
        ("kwplug", "loaded"),
        ("kwplug-x", "loaded"),
    ]
    # Neither is dropped: the third-party default is registered beside the built-in.
    accelerator = kwplug.Accelerator(cpu=True)
    registered = dict(accelerator.plugin_manager.list_name_plugin())
    assert type(registered["kwplug-x:fsdp"]) is sys.modules[name].OtherSharding
    # A bare name in a config file is ambiguous: an error naming both.
    with pytest.raises(
        kwplug.errors.ConfigError, match="kwplug-x:fsdp.*kwplug:fsdp|kwplug:fsdp.*kwplug-x:fsdp"
    ):
        kwplug.Accelerator.from_config({"handlers": {"fsdp": {}}})
    # `kwplug plugins` prints the clash under its table.
    assert kwplug.cli.main(["plugins"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "name clash" in line]
    assert lines == [
        "name clash: 'fsdp' is declared by kwplug-x 1.2 (third-party) and kwplug 0.1.0 "
        "(built-in); each loads as its own plugin, select one by 'kwplug-x:fsdp' or "
        "'kwplug:fsdp'"
    ]


def test_two_third_party_distributions_with_one_name_are_reported(
    kwplug_plugins: PluginSandbox, modules: Path
) -> None:
    first = write(modules, "kwplug_clash_a", "X = 1\n")
    second = write(modules, "kwplug_clash_b", "X = 2\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kwplug_plugins.add(first, name="tool", distribution="kwplug-a")
        kwplug_plugins.add(second, name="tool", distribution="kwplug-b")
    (message,) = _clash_warnings(caught)
    assert "'tool'" in message and "kwplug-a 0.0.0" in message and "kwplug-b 0.0.0" in message
    assert {r.distribution for r in kwplug.discover() if r.name == "tool"} == {
        "kwplug-a",
        "kwplug-b",
    }
    kwplug.Accelerator(cpu=True)  # never crashes the run


@pytest.mark.parametrize(
    "control",
    [("KWPLUG_BLOCK_PLUGINS", "kwplug-x"), ("KWPLUG_PLUGINS", ""), ("KWPLUG_PLUGINS", "other")],
)
def test_a_clashing_plugin_the_user_switched_off_is_not_reported(
    kwplug_plugins: PluginSandbox,
    modules: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    control: tuple[str, str],
) -> None:
    # The warning says "each is loaded as its own plugin" and asks the user to pick one; once
    # the third-party one is blocked or left out of the allow-list, neither is true.
    name = write(
        modules,
        "kwplug_clash_off",
        """
        import attrs
        import kwplug

        @attrs.define
        class Other(kwplug.KwargsHandler):
            pass
        """,
    )
    kwplug_plugins.add(f"{name}:Other", name="ddp", distribution="kwplug-x")
    kwplug_plugins.add(f"{name}:Other", name="other", distribution="kwplug-y")
    monkeypatch.setenv(*control)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = kwplug.discover(refresh=True)
    assert ("kwplug-x", "ddp") in {(r.distribution, r.name) for r in records}
    assert _clash_warnings(caught) == []
    assert kwplug.cli.main(["plugins"]) == 0
    assert "name clash" not in capsys.readouterr().out

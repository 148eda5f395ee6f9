"""Issue 12, items 7, 8 and 11: a plugin cannot end the run at import, a hung import is named,
the loading controls fail closed, and a hook argument with a default is refused."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
from pathlib import Path

import attrs
import pytest
import torch

import kwplug
from kwplug._plugins import _discovery
from kwplug._plugins._controls import LoadControls
from kwplug.cli import format_table, main, plugin_rows
from kwplug.errors import PluginLoadError, PluginLoadWarning
from kwplug.testing import PluginSandbox, check_handler


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on ``sys.path`` for plugin modules written by a test (removed afterwards)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("kwplug_trust_")]:
        del sys.modules[name]


def write(folder: Path, name: str, source: str) -> str:
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    return name


# -- item 7: BaseException at import, hung imports ------------------------------------------


@pytest.mark.parametrize("statement", ["raise SystemExit(3)", "raise GeneratorExit('bye')"])
def test_plugin_raising_base_exception_at_import_is_isolated(
    kwplug_plugins: PluginSandbox, modules: Path, statement: str
) -> None:
    name = write(modules, f"kwplug_trust_exit{len(statement)}", statement + "\n")
    with pytest.warns(PluginLoadWarning, match="failed to load and is skipped"):
        record = kwplug_plugins.add(name, name="quitter", distribution="kwplug-quitter")
    assert record.status == "failed"
    assert record.error is not None and record.error.split(":")[0] in statement
    # The training script goes on: an Accelerator builds with the built-ins.
    assert kwplug.Accelerator(cpu=True).device.type == "cpu"


def test_cli_survives_plugin_calling_sys_exit(
    kwplug_plugins: PluginSandbox, modules: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = write(modules, "kwplug_trust_cliexit", "import sys\nsys.exit(3)\n")
    with pytest.warns(PluginLoadWarning):
        kwplug_plugins.add(name, name="quitter", distribution="kwplug-quitter")
        assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["quitter"]["status"] == "failed"
    assert rows["quitter"]["error"] == "SystemExit: 3"


def test_keyboard_interrupt_at_import_still_stops_the_program(
    kwplug_plugins: PluginSandbox, modules: Path
) -> None:
    name = write(modules, "kwplug_trust_ctrlc", "raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        kwplug_plugins.add(name, name="ctrlc", distribution="kwplug-ctrlc")


def test_hung_import_is_named_while_it_runs(
    kwplug_plugins: PluginSandbox,
    modules: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The import records whether the report was already logged while it was still sleeping.
    name = write(
        modules,
        "kwplug_trust_sleepy",
        """
        import logging, time
        class _Seen(logging.Handler):
            def emit(self, record):
                SEEN.append(record.getMessage())
        SEEN = []
        logging.getLogger("kwplug.discovery").addHandler(_Seen())
        time.sleep(1.5)
        SEEN_DURING_IMPORT = list(SEEN)
        """,
    )
    monkeypatch.setattr(_discovery, "HUNG_IMPORT_SECONDS", 0.3)
    caplog.set_level(logging.WARNING, logger="kwplug.discovery")
    with pytest.warns(PluginLoadWarning, match=r"took \d+\.\d s to import"):
        record = kwplug_plugins.add(name, name="sleepy", distribution="kwplug-sleepy")
    assert record.status == "loaded"
    during = sys.modules[name].SEEN_DURING_IMPORT
    assert len(during) == 1
    assert "still importing handler plugin 'sleepy' (kwplug-sleepy 0.0.0)" in during[0]
    assert "KWPLUG_BLOCK_PLUGINS=kwplug-sleepy:sleepy" in during[0]


def test_fast_import_is_not_reported_as_hung(
    kwplug_plugins: PluginSandbox, modules: Path, caplog: pytest.LogCaptureFixture
) -> None:
    name = write(modules, "kwplug_trust_quick", "VALUE = 1\n")
    caplog.set_level(logging.WARNING, logger="kwplug.discovery")
    kwplug_plugins.add(name, name="quick", distribution="kwplug-quick")
    assert not [r for r in caplog.records if "still importing" in r.getMessage()]


# -- item 8: loading controls fail closed ---------------------------------------------------


@pytest.mark.parametrize(
    "value", ["1", "true", "TRUE", "yes", "y", "2", "please", " on ", " ", "\t", "  \n"]
)
def test_disable_autoload_disables_on_any_value_but_0_or_false(value: str) -> None:
    # Whitespace is a non-empty value: it disables, as PYTEST_DISABLE_PLUGIN_AUTOLOAD does.
    assert LoadControls.from_env({"KWPLUG_DISABLE_PLUGIN_AUTOLOAD": value}).builtins_only


def test_whitespace_disable_value_keeps_third_party_plugins_unimported(
    kwplug_plugins: PluginSandbox, modules: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 18 item 5: KWPLUG_DISABLE_PLUGIN_AUTOLOAD=" " loaded every plugin.
    name = write(modules, "kwplug_trust_spaced", "import sys\nsys.modules[__name__].HIT = 1\n")
    kwplug_plugins.add(name, name="spaced", distribution="kwplug-spaced")
    del sys.modules[name]
    monkeypatch.setenv("KWPLUG_DISABLE_PLUGIN_AUTOLOAD", " ")
    statuses = {r.name: r.status for r in kwplug.discover(refresh=True)}
    assert statuses["spaced"] == "disabled" and statuses["autocast"] == "loaded"
    assert name not in sys.modules  # never imported


@pytest.mark.parametrize("value", ["", "0", "false", "False", " 0 "])
def test_disable_autoload_off_values(value: str) -> None:
    assert not LoadControls.from_env({"KWPLUG_DISABLE_PLUGIN_AUTOLOAD": value}).builtins_only


@pytest.mark.parametrize("value", ["2", "ture", "strict", "enabled"])
def test_unknown_strict_value_is_an_error(value: str) -> None:
    with pytest.raises(PluginLoadError, match=rf"KWPLUG_STRICT_PLUGINS='{value}'.*1, on"):
        LoadControls.from_env({"KWPLUG_STRICT_PLUGINS": value})


def test_unknown_strict_value_fails_discovery_and_cli(
    kwplug_plugins: PluginSandbox,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("KWPLUG_STRICT_PLUGINS", "ture")
    with pytest.raises(PluginLoadError):
        kwplug.discover()
    assert main(["plugins"]) == 2
    assert "KWPLUG_STRICT_PLUGINS='ture'" in capsys.readouterr().err


def test_strict_cli_lists_the_failure_instead_of_crashing(
    kwplug_plugins: PluginSandbox,
    modules: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = write(modules, "kwplug_trust_broken", "raise ImportError('missing dependency xyz')\n")
    with pytest.warns(PluginLoadWarning):
        kwplug_plugins.add(name, name="broken", distribution="kwplug-broken")
    monkeypatch.setenv("KWPLUG_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match="missing dependency xyz"):
        kwplug.discover()
    assert main(["plugins"]) == 1
    captured = capsys.readouterr()
    line = next(line for line in captured.out.splitlines() if line.startswith("broken "))
    assert line.split()[-2:] == ["failed", "third-party"]  # one word, then the next column
    assert "missing dependency xyz" in captured.err
    assert main(["plugins", "--json"]) == 1
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["broken"]["error"] == "ImportError: missing dependency xyz"


def test_failed_status_keeps_the_table_readable(
    kwplug_plugins: PluginSandbox, modules: Path
) -> None:
    long = "x" * 300
    name = write(modules, "kwplug_trust_verbose", f"raise RuntimeError({long!r})\n")
    with pytest.warns(PluginLoadWarning):
        kwplug_plugins.add(name, name="verbose", distribution="kwplug-verbose")
    table = format_table(plugin_rows(kwplug_plugins.records()))
    assert long not in table
    assert max(len(line) for line in table.splitlines()) < 200


def test_qualified_name_is_never_ambiguous(kwplug_plugins: PluginSandbox, modules: Path) -> None:
    # kwplug-evil declares an entry point *named* "kwplug-good:tool": KWPLUG_PLUGINS naming
    # kwplug-good's entry point "tool" must not enable it.
    good = write(modules, "kwplug_trust_good", "GOOD = True\n")
    evil = write(modules, "kwplug_trust_evil", "EVIL = True\n")
    kwplug_plugins.add(good, name="tool", distribution="kwplug-good")
    kwplug_plugins.add(evil, name="kwplug-good:tool", distribution="kwplug-evil")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KWPLUG_PLUGINS", "kwplug-good:tool")
        statuses = {(r.distribution, r.name): r.status for r in kwplug.discover(refresh=True)}
    assert statuses[("kwplug-good", "tool")] == "loaded"
    assert statuses[("kwplug-evil", "kwplug-good:tool")] == "disabled"


def test_metadata_folder_named_kwplug_is_not_built_in(
    kwplug_plugins: PluginSandbox, modules: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = write(modules, "kwplug_trust_impostor", "IMPOSTOR = True\n")
    monkeypatch.setenv("KWPLUG_DISABLE_PLUGIN_AUTOLOAD", "1")
    kwplug_plugins.add(name, name="impostor", distribution="kwplug", version="0.1.0")
    records = {r.name: r for r in kwplug.discover(refresh=True)}
    assert records["impostor"].source == "third-party"
    assert records["impostor"].status == "disabled"
    assert name not in sys.modules
    # kwplug's genuine built-ins are still built-in, and not shadowed by the impostor.
    assert records["ddp"].builtin and records["ddp"].loaded


# -- item 11: hook arguments with defaults --------------------------------------------------


@attrs.define
class DefaultedAutocast(kwplug.KwargsHandler):
    """pluggy would call ``autocast(device_type)`` only: ``mixed_precision`` stays "no"."""

    @kwplug.hookimpl
    def autocast(self, device_type: str, mixed_precision: str = "no") -> object:
        dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
        return lambda: torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32)


def test_defaulted_hook_argument_refused_by_accelerator() -> None:
    with pytest.raises(TypeError, match=r"autocast\(mixed_precision=\.\.\.\)"):
        kwplug.Accelerator(cpu=True, mixed_precision="bf16", kwargs_handlers=[DefaultedAutocast()])


def test_defaulted_hook_argument_refused_by_check_handler() -> None:
    with pytest.raises(AssertionError, match=r"autocast\(mixed_precision=\.\.\.\)"):
        check_handler(DefaultedAutocast)


def test_defaulted_hook_argument_refused_at_load(kwplug_plugins: PluginSandbox) -> None:
    with pytest.warns(PluginLoadWarning, match="mixed_precision"):
        record = kwplug_plugins.add(DefaultedAutocast, name="defaulted")
    assert record.status == "failed"
    # A bf16 run computes in bf16: the refused plugin does not answer autocast.
    accelerator = kwplug.Accelerator(cpu=True, mixed_precision="bf16")
    with accelerator.autocast():
        out = torch.nn.Linear(4, 4)(torch.ones(2, 4))
    assert out.dtype == torch.bfloat16

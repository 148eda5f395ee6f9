"""A real third-party plugin distribution: built, pip-installed, discovered by entry point."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from plugin_site import pip_install, run_json
from python import python

PLUGIN_MODULE = '''
import functools

import attrs
import torch

import kwplug


@attrs.define
class HalfAutocastKwargs(kwplug.KwargsHandler):
    """Autocast to float16 on CPU whatever mixed_precision says (a toy backend policy)."""

    dtype_name: str = attrs.field(default="float16", validator=attrs.validators.in_(["float16"]))

    @kwplug.hookimpl
    def autocast(self, device_type):
        if device_type != "cpu":
            return None
        return functools.partial(torch.autocast, "cpu", dtype=getattr(torch, self.dtype_name))
'''

BROKEN_MODULE = "raise ImportError('this plugin is broken on purpose')\n"

PYPROJECT = """
[build-system]
requires = ["setuptools>=69"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "1.2.3"
dependencies = []

[project.entry-points."kwplug.handlers"]
{ep} = "{module}{attr}"

[tool.setuptools]
py-modules = ["{module}"]
"""

PROBE = textwrap.dedent(
    """
    import json, warnings
    import torch, kwplug
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = kwplug.discover()
        acc = kwplug.Accelerator(mixed_precision="bf16", cpu=True)
    with acc.autocast():
        dtype = str(torch.get_autocast_dtype("cpu"))
    print(json.dumps({
        "dtype": dtype,
        "plugins": [[r.name, r.distribution, r.version, r.error, r.status] for r in records],
        "warnings": [str(w.message) for w in caught],
    }))
    """
)


def build_dist(root: Path, name: str, ep: str, module: str, attr: str, source: str) -> Path:
    src = root / name
    src.mkdir()
    (src / "pyproject.toml").write_text(
        PYPROJECT.format(name=name, ep=ep, module=module, attr=attr)
    )
    (src / f"{module}.py").write_text(source)
    return src


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plugins")
    target = root / "site"
    good = build_dist(
        root, "kwplug-halfcast", "halfcast", "kwplug_halfcast", ":HalfAutocastKwargs", PLUGIN_MODULE
    )
    broken = build_dist(root, "kwplug-broken", "broken", "kwplug_broken", "", BROKEN_MODULE)
    pip_install([good, broken], target)
    return target


def probe(site: Path, **env: str) -> dict:
    return run_json(PROBE, site, **env)  # type: ignore[no-any-return]


def test_installed_plugin_drives_autocast_and_broken_one_is_reported(site: Path) -> None:
    result = probe(site)
    # The third-party default answers before the built-in AutocastKwargs (bf16).
    assert result["dtype"] == "torch.float16"
    plugins = {p[0]: p for p in result["plugins"]}
    assert plugins["halfcast"][1:] == ["kwplug-halfcast", "1.2.3", None, "loaded"]
    assert plugins["autocast"][1] == "kwplug"
    broken = plugins["broken"]
    assert broken[1:3] == ["kwplug-broken", "1.2.3"]
    assert "ImportError: this plugin is broken on purpose" in broken[3]
    assert broken[4] == "failed"
    # One warning naming the plugin, its distribution and version, and the cause.
    [warning] = [w for w in result["warnings"] if "broken" in w]
    assert "'broken' (kwplug-broken 1.2.3)" in warning and "broken on purpose" in warning
    # Order: third-party (by distribution) before built-ins.
    names = [p[0] for p in result["plugins"]]
    assert names.index("halfcast") < names.index("autocast")


def statuses(result: dict) -> dict[str, str]:
    return {p[0]: p[4] for p in result["plugins"]}


def test_disable_autoload_keeps_only_builtins(site: Path) -> None:
    result = probe(site, KWPLUG_DISABLE_PLUGIN_AUTOLOAD="1")
    assert result["dtype"] == "torch.bfloat16"
    status = statuses(result)
    assert status["halfcast"] == status["broken"] == "disabled"
    # Built-ins load; every third-party plugin installed here is disabled.
    assert {p[4] for p in result["plugins"] if p[1] == "kwplug"} == {"loaded"}
    assert {p[4] for p in result["plugins"] if p[1] != "kwplug"} == {"disabled"}
    # Disabled plugins are not even imported: the broken one raises no warning.
    assert not [w for w in result["warnings"] if "broken on purpose" in w]


def test_allow_list_by_distribution_or_entry_point(site: Path) -> None:
    for allow in ("kwplug-halfcast", "halfcast", "kwplug-halfcast:halfcast"):
        result = probe(site, KWPLUG_PLUGINS=allow)
        assert result["dtype"] == "torch.float16"
        assert statuses(result)["broken"] == "disabled"
        assert not [w for w in result["warnings"] if "broken on purpose" in w]
    result = probe(site, KWPLUG_PLUGINS="")  # set but empty: no third-party plugins
    assert result["dtype"] == "torch.bfloat16"
    assert statuses(result)["halfcast"] == "disabled"


def test_block_list_and_unknown_names(site: Path) -> None:
    result = probe(site, KWPLUG_BLOCK_PLUGINS="halfcast,broken,no-such-plugin")
    assert result["dtype"] == "torch.bfloat16"
    assert statuses(result)["halfcast"] == statuses(result)["broken"] == "blocked"
    [warning] = [w for w in result["warnings"] if "no-such-plugin" in w]
    assert "KWPLUG_BLOCK_PLUGINS" in warning and "halfcast (kwplug-halfcast)" in warning


def test_strict_mode_turns_a_load_failure_into_an_error(site: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(site), "KWPLUG_STRICT_PLUGINS": "1"}
    run = python("-c", "import kwplug; kwplug.Accelerator()", env=env, timeout=120)
    assert run.returncode != 0
    assert "PluginLoadError" in run.stderr
    assert "'broken' (kwplug-broken 1.2.3)" in run.stderr and "broken on purpose" in run.stderr


def cli(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(site), **env}
    return python("-m", "kwplug", *args, env=full_env, timeout=120, check=True)


def test_cli_plugins_lists_every_plugin_with_status(site: Path) -> None:
    rows = {r["name"]: r for r in json.loads(cli(site, "plugins", "--json").stdout)}
    assert rows["halfcast"] == {
        "name": "halfcast",
        "class": "kwplug_halfcast.HalfAutocastKwargs",
        "distribution": "kwplug-halfcast",
        "version": "1.2.3",
        "hooks": ["autocast"],
        "status": "loaded",
        "source": "third-party",
        "default": True,
        "device_types": None,
        "error": None,
    }
    assert rows["broken"]["default"] is None  # not loaded: not known
    assert rows["broken"]["status"] == "failed"  # one word: the table stays readable
    assert rows["broken"]["error"].startswith("ImportError: this plugin is broken")
    assert (
        rows["ddp"]["hooks"] == ["no_sync", "sync_in_backward", "validate_setup", "wrap_model"]
        and rows["ddp"]["source"] == "built-in"
    )
    # The names shown are the names the controls accept.
    blocked = json.loads(cli(site, "plugins", "--json", KWPLUG_BLOCK_PLUGINS="halfcast").stdout)
    assert {r["name"]: r["status"] for r in blocked}["halfcast"] == "blocked"
    table = cli(site, "plugins").stdout
    assert table.splitlines()[0].split() == [
        "NAME",
        "CLASS",
        "DISTRIBUTION",
        "VERSION",
        "HOOKS",
        "STATUS",
        "SOURCE",
    ]
    assert "kwplug-halfcast" in table
    env = cli(site, "env").stdout
    assert "- PyTorch version: " in env and "gloo=yes" in env and "halfcast" in env


def test_cli_explain_shows_order_and_what_reaches_torch(site: Path) -> None:
    report = json.loads(
        cli(site, "plugins", "--explain", "--mixed-precision", "bf16", "--json").stdout
    )
    autocast = report["autocast"]
    assert autocast["order"][0] == "default plugin 'halfcast' (kwplug-halfcast 1.2.3)"
    assert autocast["order"][-1] == "default plugin 'autocast' (kwplug 0.1.0)"
    assert autocast["answered_by"].startswith("default plugin 'halfcast'")
    assert autocast["reaches_torch"]["kwargs"]["dtype"] == "torch.float16"
    assert report["make_scaler"]["reaches_torch"] == "None"  # no scaler without fp16
    assert report["init_process_group"]["fields"]["backend"] == "'gloo'"  # resolved on cpu
    text = cli(site, "plugins", "--explain", "--mixed-precision", "fp16").stdout
    assert "answered_by" in text and "GradScaler" in text

"""Issue 21's rough edges: ``import kwplug.testing`` without pytest names the extra; each
runtime requirement is listed once; the slow-import warning measures the plugin, not torch;
README's 15-line handler with its complete ``pyproject.toml`` installs as a working plugin."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import importlib_metadata
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_testing_kit_without_pytest_names_the_extra() -> None:
    # pytest made unimportable in a fresh interpreter (None in sys.modules blocks an import).
    code = "import sys; sys.modules['pytest'] = None; import kwplug.testing"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "ModuleNotFoundError: kwplug.testing needs pytest" in result.stderr
    assert "pip install 'kwplug[testing]'" in result.stderr


def test_each_dependency_is_listed_once() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lists = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    for name, requirements in lists.items():
        names = [Requirement(r).name.lower() for r in requirements]
        assert len(names) == len(set(names)), f"{name}: {sorted(names)}"


def test_every_package_folder_is_in_the_wheel() -> None:
    # setuptools' explicit `packages` list does not recurse: a folder left out installs in
    # editable mode (the test venv) and is missing from a built wheel (kwplug._data was).
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {folder: name for name, folder in setuptools["package-dir"].items()}
    found = set()
    for folder, name in roots.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *parts)))
    assert sorted(found - set(setuptools["packages"])) == []


PROBE_PLUGIN = """\
import sys
import time

TORCH_ALREADY = "torch" in sys.modules
import torch  # noqa: E402,F401  (what every real plugin does)

import kwplug  # noqa: E402


@kwplug.hookimpl
def trackers():
    return {}
"""


def test_slow_import_warning_measures_the_plugin_not_torch(tmp_path: Path) -> None:
    # A fresh interpreter, as `kwplug plugins` in a shell: torch not yet imported. Only the
    # probe loads (built-ins blocked): before the fix, its load time was torch's import and
    # `kwplug plugins` warned "took 4.5 s to import".
    root = tmp_path / "site"
    info = root / "kwplug_probe-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kwplug-probe\nVersion: 0.1\nRequires-Dist: kwplug>=0.1\n"
    )
    (info / "entry_points.txt").write_text("[kwplug.handlers]\nprobe = kwplug_probe\n")
    (root / "kwplug_probe.py").write_text(PROBE_PLUGIN)
    code = (
        "import json, sys, warnings; warnings.simplefilter('always')\n"
        "from kwplug._plugins import discover\n"
        "assert 'torch' not in sys.modules\n"
        "records = {r.name: r for r in discover()}\n"
        "import kwplug_probe\n"
        "print(json.dumps([records['probe'].status, records['probe'].load_seconds,"
        " kwplug_probe.TORCH_ALREADY]))\n"
    )
    builtins = importlib_metadata.distribution("kwplug").entry_points.select(
        group="kwplug.handlers"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "KWPLUG_NO_CACHE": "1",
        "KWPLUG_BLOCK_PLUGINS": ",".join(ep.name for ep in builtins),
    }
    env.pop("KWPLUG_DISABLE_PLUGIN_AUTOLOAD", None)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    status, seconds, torch_already = json.loads(result.stdout.splitlines()[-1])
    assert status == "loaded" and torch_already, result.stderr
    assert "to import" not in result.stderr and seconds < 1.0


def test_readme_handler_and_its_pyproject_install_as_a_plugin(tmp_path: Path) -> None:
    # README's "A third-party handler in 15 lines": its Python block and its complete
    # pyproject.toml, pip-installed as they are, give a loaded plugin answering `autocast`.
    from plugin_site import pip_install, run_json

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## A third-party handler in 15 lines", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    pyproject = re.search(r"```toml\n(.*?)```", section, re.S)
    assert code and pyproject, "the section lost its python or toml block"
    assert "[build-system]" in pyproject.group(1) and "[project]" in pyproject.group(1)
    project = tmp_path / "project"
    (project / "mybackend").mkdir(parents=True)
    (project / "mybackend" / "__init__.py").write_text("")
    (project / "mybackend" / "kwplug_plugin.py").write_text(code.group(1))
    (project / "pyproject.toml").write_text(pyproject.group(1))
    site = pip_install([project], tmp_path / "site")
    probe = (
        "import json\nfrom kwplug._plugins import discover\n"
        "r = {x.name: x for x in discover()}['mybackend_autocast']\n"
        "print(json.dumps([r.status, list(r.hooks), r.distribution]))\n"
    )
    assert run_json(probe, site) == ["loaded", ["autocast"], "mybackend-kwplug"]

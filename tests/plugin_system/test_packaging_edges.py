"""Issue 21's rough edges: ``import kwplug.testing`` without pytest names the extra; each
runtime requirement is listed once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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

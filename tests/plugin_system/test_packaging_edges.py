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

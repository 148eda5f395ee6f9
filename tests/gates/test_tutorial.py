"""The plugin tutorial (docs/writing-plugins.md) for real: its files are written out, the
package is pip-installed, and its example and its own test suite run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_site import pip_install
from torchrun import torchrun

PAGE = Path(__file__).parents[2] / "docs" / "writing-plugins.md"
# A file of the tutorial: a line "`path`:", a blank line, then a fenced block.
FILE_BLOCK = re.compile(r"^`([\w./-]+)`:\n\n```\w+\n(.*?)^```", re.S | re.M)


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(project folder, site folder with kwplug-extras installed)."""
    project = tmp_path_factory.mktemp("kwplug-extras")
    files = dict(FILE_BLOCK.findall(PAGE.read_text()))
    assert set(files) == {
        "kwplug_extras.py",
        "pyproject.toml",
        "examples/train_clipped.py",
        "tests/conftest.py",
        "tests/test_kwplug_extras.py",
    }
    for name, text in files.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    site = pip_install([project], tmp_path_factory.mktemp("site"))
    return project, site


def _env(site: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    env.pop("KWPLUG_DISABLE_PLUGIN_AUTOLOAD", None)
    return env


def test_tutorial_example_runs_in_one_and_two_processes(tutorial: tuple[Path, Path]) -> None:
    project, site = tutorial
    script = project / "examples" / "train_clipped.py"
    one = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=_env(site),
        timeout=120,
        check=True,
    )
    assert re.search(r"Linear on 1 process\(es\): loss [\d.]+, ranks in sync: True", one.stdout)
    two = torchrun(script, nproc=2, timeout=180, env={"PYTHONPATH": str(site)})
    assert re.search(
        r"DistributedDataParallel on 2 process\(es\): loss [\d.]+, ranks in sync: True",
        two.stdout,
    ), two.stdout


def test_tutorial_test_suite_passes(tutorial: tuple[Path, Path]) -> None:
    project, site = tutorial
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        capture_output=True,
        text=True,
        cwd=project,
        env={**_env(site), "KWPLUG_STRICT_PLUGINS": "1"},
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert re.search(r"\b6 passed\b", result.stdout), result.stdout[-2000:]

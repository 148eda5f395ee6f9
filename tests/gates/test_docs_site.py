"""The documentation site builds with `mkdocs build --strict` (broken references fail)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    if subprocess.run(
        [sys.executable, "-c", "import mkdocs, mkdocstrings, material"],
        check=False,
        capture_output=True,
    ).returncode:
        pytest.fail("the docs extra is not installed: pip install -e '.[test,dev,docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for page in (
        "index.html",
        "architecture/index.html",
        "handlers/ddp/index.html",
        "reference/core/index.html",
        "writing-plugins/index.html",
    ):
        assert (tmp_path / "site" / page).is_file(), page
    reference = (tmp_path / "site" / "reference" / "core" / "index.html").read_text()
    assert "init_process_group" in reference and "Accelerator" in reference

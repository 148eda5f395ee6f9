"""Quality gates run with the tests: ruff (lint + format) and mypy --strict."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
TYPING_EXAMPLE = ROOT / "tests" / "typing" / "public_api.py"
# Wrong hook calls, each with the ignore mypy must need for it (an unneeded one fails).
TYPING_RELAYS = ROOT / "tests" / "typing" / "hook_relays.py"


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False, env=env
    )


def require(module: str) -> None:
    # The README's test command installs the `dev` extra; a missing tool is a broken set-up.
    if subprocess.run([sys.executable, "-c", f"import {module}"], check=False).returncode:
        pytest.fail(f"{module} is not installed: pip install -e '.[test,dev]'")


def test_ruff_check() -> None:
    require("ruff")
    result = run(sys.executable, "-m", "ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format() -> None:
    require("ruff")
    result = run(sys.executable, "-m", "ruff", "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict() -> None:
    require("mypy")
    bash = shutil.which("bash")
    assert bash is not None
    # core/ and plugins/, plus a file using the public API as users and plugin authors do, and
    # the hook relays' call sites, right and wrong
    result = run(bash, str(ROOT / ".ci" / "typecheck"), str(TYPING_EXAMPLE), str(TYPING_RELAYS))
    assert result.returncode == 0, result.stdout + result.stderr

"""Helpers for tests that pip-install real plugin distributions into a private site folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from python import python


def pip_install(sources: Sequence[Path], target: Path) -> Path:
    """``pip install --target`` the given project folders (no deps, no build isolation)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            *map(str, sources),
        ],
        check=True,
        timeout=300,
    )
    return target


def run_json(code: str, site: Path, **env: str) -> Any:
    """Run ``python -c code`` with ``site`` on the path; the JSON on its last output line."""
    full_env = {**os.environ, "PYTHONPATH": str(site)}
    full_env.pop("KWPLUG_DISABLE_PLUGIN_AUTOLOAD", None)
    full_env.update(env)
    out = python("-c", code, env=full_env, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


MODULE_PLUGIN = """
[build-system]
requires = ["setuptools>=69"]
build-backend = "setuptools.build_meta"
[project]
name = "kwplug-{ep}"
version = "0.0.1"
[project.entry-points."kwplug.handlers"]
{ep} = "kwplug_{ep}"
[tool.setuptools]
py-modules = ["kwplug_{ep}"]
"""


def install_module_plugins(sources: dict[str, str], root: Path) -> Path:
    """pip-install one module plugin per ``sources`` item (entry point ``name``, distribution
    ``kwplug-<name>``, module ``kwplug_<name>`` holding the source) into ``root/site``."""
    folders = []
    for ep, source in sources.items():
        src = root / ep
        src.mkdir()
        (src / "pyproject.toml").write_text(MODULE_PLUGIN.format(ep=ep))
        (src / f"kwplug_{ep}.py").write_text(source)
        folders.append(src)
    return pip_install(folders, root / "site")

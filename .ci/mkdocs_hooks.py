"""MkDocs hook: give mkdocstrings a source tree shaped like the installed package.

setuptools maps ``kwplug`` to ``core/`` and ``kwplug.plugins`` to ``plugins/``; griffe reads
sources by package name, so a tree of links named ``kwplug`` is built when MkDocs loads this
hook (before the plugins read their configuration).
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "docs-src"


def _build_tree() -> None:
    package = TREE / "kwplug"
    if TREE.exists():
        shutil.rmtree(TREE)
    package.mkdir(parents=True)
    for source in (ROOT / "core").glob("*.py"):
        (package / source.name).symlink_to(source)
    (package / "plugins").symlink_to(ROOT / "plugins", target_is_directory=True)
    for init in (ROOT / "core").glob("*/__init__.py"):  # kwplug.accelerator, kwplug.testing, ...
        (package / init.parent.name).symlink_to(init.parent, target_is_directory=True)


_build_tree()

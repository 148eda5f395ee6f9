"""What ``save_state`` pre-hooks wrote, where Accelerate puts it: in the checkpoint directory
itself (``checkpoint-<n>/unet``, so that ``UNet2DModel.from_pretrained(ckpt, subfolder="unet")``
loads), while the files stay inside kwplug's version folder (committed, verified, pruned).

After a version's marker is written (step ``link`` of :mod:`kwplug.checkpoint._commit`), each
top-level name ``N`` the hooks wrote gets ``DIR/N``, a relative symbolic link to
``kwplug-<n>/N``, replaced atomically (a new link under a temporary name, then
``os.replace``), before the older versions are pruned: ``DIR/N`` always names a complete
version's files. After pruning, kwplug's links whose version is gone are removed. A kill
between the marker and the link leaves the links at the previous version (still there):
``load_state`` repoints them at the version it reads (:func:`repair`).

Only kwplug's links are ever replaced or removed: a link whose target is exactly
``kwplug-<8 digits>/<its own name>``. A user's file, folder or other link under such a name
is never followed, replaced or removed; a ``KwplugWarning`` says the hook's output stays in
the version folder only.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable
from pathlib import Path

from kwplug.checkpoint import _layout as layout
from kwplug.errors import KwplugWarning

_TEMP = ".kwplug-link-"


def hook_names(records: Iterable[str]) -> set[str]:
    """The top-level names in a version folder that the save hooks wrote (its manifest's
    ``records``, less kwplug's own files), which a link may carry into the directory."""
    names = {name.split("/", 1)[0] for name in records if not layout.is_own_file(name)}
    return {n for n in names if not _reserved(n)}


def _reserved(name: str) -> bool:
    # Names kwplug itself uses in the checkpoint directory are never linked over.
    return (
        name.startswith(".kwplug")
        or layout.version_number(name) is not None
        or layout.trash_number(name) is not None
    )


def is_own_link(path: Path) -> bool:
    """True when ``path`` is a link kwplug made: its target is ``kwplug-<n>/<its name>``."""
    if not path.is_symlink():
        return False
    try:
        target = os.readlink(path)
    except OSError:
        return False
    version, _, name = target.partition("/")
    return layout.version_number(version) is not None and name == path.name


def is_temp_link(path: Path) -> bool:
    """A link :func:`point` was creating when the process was killed."""
    return path.name.startswith(_TEMP) and path.is_symlink()


def point(directory: Path, version: Path, names: Iterable[str], *, quiet: bool = False) -> None:
    """Make ``directory/<name>`` a link to ``version/<name>`` for each of ``names``
    (``version`` a complete version folder inside ``directory``).

    Args:
        directory: the checkpoint directory.
        version: the version folder the links name.
        names: top-level names the save hooks wrote (:func:`hook_names`).
        quiet: no warning for a user's entry under such a name (a load repairing links).
    """
    for name in sorted(names):
        path = directory / name
        if (path.exists() or path.is_symlink()) and not is_own_link(path):
            if not quiet:
                warnings.warn(
                    f"{path} exists and is not kwplug's: what a save_state pre-hook wrote "
                    f"there is in {version / name} only (kwplug never replaces a file of "
                    "yours; remove it to get the link)",
                    KwplugWarning,
                    stacklevel=4,
                )
            continue
        target = f"{version.name}/{name}"
        if path.is_symlink() and os.readlink(path) == target:
            continue
        temp = directory / f"{_TEMP}{os.getpid()}"
        if temp.is_symlink():
            temp.unlink()
        os.symlink(target, temp)
        os.replace(temp, path)  # atomic: the name always resolves (to the old or new files)


def clean(directory: Path) -> None:
    """Remove kwplug's links whose version folder is gone and temporary links of killed
    saves (nothing else)."""
    for child in directory.iterdir():
        if is_temp_link(child) or (is_own_link(child) and not child.exists()):
            with contextlib.suppress(FileNotFoundError):
                child.unlink()


def repair(directory: Path, version: Path, records: Iterable[str]) -> None:
    """On load: point kwplug's links at ``version`` (the version read), create missing ones,
    and remove stale ones (a save killed between its marker and its links). Best effort: an
    ``OSError`` (a read-only directory) leaves them as they are."""
    if version.parent != directory:
        return
    with contextlib.suppress(OSError):
        point(directory, version, hook_names(records), quiet=True)
        clean(directory)

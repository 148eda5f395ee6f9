"""The commit protocol: how a checkpoint directory is written, found and replaced.

A checkpoint directory ``DIR`` may hold anything else (logs, the training script): kwplug
only ever creates, and deletes, the names of :mod:`kwplug.checkpoint._layout`. Each save is a
new version folder ``DIR/kwplug-<n>`` (``n`` one more than any version there), committed in
named steps, in this order (:data:`STEPS`):

1. ``lock``: take ``DIR/.kwplug.lock`` (:mod:`kwplug.checkpoint._lock`).
2. ``clean``: delete versions without a marker and trash left by killed saves.
3. ``stage``: create ``DIR/kwplug-<n>``; every rank writes its files into it. ``n`` is one
   more than any version name in ``DIR``, whatever holds it: a link or a file planted under a
   version's name is skipped, never followed, and left alone.
4. ``manifest``: rank 0 writes ``MANIFEST.json`` (every file, its size and checksum).
5. ``mark``: rank 0 writes ``COMPLETE`` (a temporary file renamed; the rename commits).
6. ``link``: each top-level name ``N`` a ``save_state`` pre-hook wrote becomes ``DIR/N``, a
   relative link to ``kwplug-<n>/N`` replaced atomically (:mod:`kwplug.checkpoint._links`:
   Accelerate's ``checkpoint/unet``); never over a user's own file.
7. ``prune``: every older version is renamed to ``DIR/.kwplug-trash-<m>``, then deleted;
   then kwplug's links left pointing at no version are removed.
8. ``unlock``.

The newest version with a marker is the checkpoint (:func:`resolve_checkpoint`). A kill at
any instant of any step, any number of times in a row, leaves it loadable: a version is only
ever deleted after a newer one has its marker, and the marker is written after all files
and the manifest; a version being deleted is first renamed to a trash name, which is never
read. Versions without a marker are never read either.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path

from kwplug.checkpoint import _codec as codec
from kwplug.checkpoint import _layout as layout
from kwplug.checkpoint import _links as links
from kwplug.checkpoint import _manifest as manifest
from kwplug.checkpoint import _reader as reader
from kwplug.errors import CheckpointError, KwplugWarning

STEPS = ("lock", "clean", "stage", "manifest", "mark", "link", "prune", "unlock")


def reached(step: str) -> None:
    """Called as each step of :data:`STEPS` begins (tests kill the process here)."""


def fsync_dir(path: Path) -> None:
    """Make ``path``'s entries durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def versions(directory: Path) -> dict[int, Path]:
    """The version folders in ``directory`` by number, complete or not."""
    found: dict[int, Path] = {}
    if directory.is_dir():
        for child in directory.iterdir():
            number = layout.version_number(child.name)
            if number is not None and child.is_dir() and not child.is_symlink():
                found[number] = child
    return found


def is_complete(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` holds a complete checkpoint (it, or one of its versions)."""
    return resolve_checkpoint(path) is not None


def resolve_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete version saved into ``directory``, or ``None`` when there is none.

    ``directory`` may also be a version folder itself.
    """
    path = Path(directory)
    if layout.version_number(path.name) is not None and (path / layout.MARKER).is_file():
        return path
    complete = [p for n, p in sorted(versions(path).items()) if (p / layout.MARKER).is_file()]
    return complete[-1] if complete else None


def listed(folder: Path) -> set[str]:
    """The files ``folder``'s manifest lists (empty when it has none or it is unreadable)."""
    path = folder / layout.MANIFEST
    try:  # read_small: a FIFO planted as the manifest is never read
        return set(manifest.parse(reader.read_small(path, limit=manifest.LIMIT), path))
    except (CheckpointError, OSError):
        return set()


def owned(folder: Path) -> bool:
    """True when ``folder`` holds only regular files: kwplug's own names (safetensors'
    temporary files among them), and those its manifest lists (what save hooks wrote); only
    such a version folder is ever deleted (never anything of the user's)."""
    extra = listed(folder)
    for name in manifest.files(folder):
        path = folder / name
        if path.is_symlink() or not path.is_file():
            return False
        if not (layout.is_own_file(name) or layout.is_writer_temp(name) or name in extra):
            return False
    return True


def _discard(folder: Path, number: int, *, checked: bool = True) -> None:
    # ``checked``: only a folder :func:`owned` holds is deleted; else the folder is this
    # save's own (see :func:`abort`).
    if checked and not owned(folder):
        return  # a folder under kwplug's name holding something else: left alone
    trash = folder.with_name(layout.trash_name(number, os.getpid()))
    os.replace(folder, trash)  # atomic: from here on nothing reads it
    fsync_dir(folder.parent)
    shutil.rmtree(trash)


def begin(directory: Path) -> Path:
    """Steps ``clean`` and ``stage`` (the lock is held): the new, empty version folder."""
    reached("clean")
    for child in directory.iterdir():
        number = layout.trash_number(child.name)
        if number is not None and child.is_dir() and not child.is_symlink() and owned(child):
            shutil.rmtree(child)
    existing = versions(directory)
    for number, folder in existing.items():
        if not (folder / layout.MARKER).is_file():
            _discard(folder, number)
    reached("stage")
    staging = _stage(directory, max(existing, default=0) + 1)
    fsync_dir(directory)
    return staging


def _stage(directory: Path, first: int) -> Path:
    # The first version name from ``first`` on that nothing holds: a link, a file or a folder
    # someone else put under a version's name is skipped (never followed, never written
    # through: mkdir does not follow a link), so it cannot block every later save.
    taken = [n for c in os.listdir(directory) if (n := layout.version_number(c)) is not None]
    number = max([first - 1, *taken]) + 1
    for attempt in range(_TRIES):
        staging = directory / layout.version_name(number + attempt)
        try:
            staging.mkdir()
            return staging
        except FileExistsError:  # created since the listing
            continue
    raise CheckpointError(
        f"cannot create a version folder in {directory}: {_TRIES} names from "
        f"{layout.version_name(number)} on were taken while saving",
        directory,
    )


_TRIES = 16


def finish(
    staging: Path, records: dict[str, tuple[int, str]], *, main_only: int | None = None
) -> None:
    """Steps ``manifest``, ``mark`` and ``prune`` (the lock is held); ``main_only``: the
    number of processes of a run whose main process saved alone (kept in the manifest)."""
    reached("manifest")
    manifest.write(staging, records, main_only=main_only)
    reached("mark")
    tmp = staging / layout.MARKER_TMP
    codec.write_file(tmp, b"kwplug checkpoint\n")
    os.replace(tmp, staging / layout.MARKER)
    fsync_dir(staging)
    fsync_dir(staging.parent)
    reached("link")
    names = links.hook_names(records)
    try:  # the version is committed: a link that cannot be made must not undo it
        if names:
            links.point(staging.parent, staging, names)
            fsync_dir(staging.parent)
    except OSError as exc:
        warnings.warn(
            f"could not link what the save_state pre-hooks wrote into {staging.parent}: "
            f"{exc}; it is in {staging}",
            KwplugWarning,
            stacklevel=4,
        )
    reached("prune")
    mine = layout.version_number(staging.name)
    for number, folder in versions(staging.parent).items():
        if mine is not None and number < mine:
            _discard(folder, number)
    with contextlib.suppress(OSError):
        links.clean(staging.parent)


def abort(staging: Path, *, hooks_wrote: bool = False) -> None:
    """Remove the version folder of a failed save: nothing but kwplug's files is removed,
    unless ``hooks_wrote`` (``save_state`` pre-hooks ran, and may have written files no
    manifest lists yet): then the whole folder, this save's own (created moments ago by
    :func:`begin`), goes with what they wrote."""
    number = layout.version_number(staging.name)
    if staging.is_dir() and number is not None:
        _discard(staging, number, checked=not hooks_wrote)


def check_directory(directory: Path) -> None:
    """Refuse a ``directory`` that is not a directory (kwplug never replaces a file).

    Raises:
        CheckpointError: ``directory`` exists and is not a directory.
    """
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(
            f"cannot save a checkpoint into {directory}: it exists and is not a directory",
            directory,
        )
    directory.mkdir(parents=True, exist_ok=True)

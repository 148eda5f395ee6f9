"""Accelerate's automatic checkpoint naming: ``ProjectConfiguration(automatic_checkpoint_naming=
True, total_limit=N, iteration=i)``.

With automatic naming, ``save_state()`` writes ``<project_dir>/checkpoints/checkpoint_<i>``
(each one an ordinary kwplug checkpoint directory, :mod:`kwplug.checkpoint._layout`) and then
increments ``iteration``; ``load_state()`` reads the highest-numbered complete one. Unlike
Accelerate:

- ``total_limit`` is applied *after* the new checkpoint is committed (Accelerate deletes
  first, so a crash while saving can leave fewer checkpoints than the limit, or none), and it
  counts and deletes only ``checkpoint_<n>`` folders that hold a complete kwplug checkpoint
  and nothing but kwplug's own files; anything else in ``checkpoints/`` is never counted,
  renamed or deleted (Accelerate counts, and deletes, every entry there).
- A folder is deleted by renaming it to ``.kwplug-trash-checkpoint_<n>-<pid>`` first (atomic;
  a trash folder is never read and the next prune finishes deleting it) while holding its
  save lock, so a concurrent saver's folder is never deleted under it.
- ``load_state`` of ``checkpoints/checkpoint_<n>`` sets ``iteration`` to ``n + 1``, so a
  resumed run continues the numbering (Accelerate keeps ``iteration`` at its configured value
  and the next save then fails on the existing folder).
- ``checkpoint_<i>`` left by a save that was killed (no complete version, only kwplug's files)
  is saved into again instead of being refused.
- Each folder is tagged with the id of the run that saved it (:mod:`kwplug.checkpoint._runs`):
  ``total_limit`` counts and deletes only this run's checkpoints, never another run's in the
  same ``project_dir`` (Accelerate deletes the oldest, whoever wrote them), and
  ``load_state()`` reads this run's newest; a run that has none yet reads the newest of the
  one run there and continues it, and refuses (``ValueError``) when several runs' are there.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from kwplug.checkpoint import _accelerate_layout as accelerate_layout
from kwplug.checkpoint import _api as api
from kwplug.checkpoint import _arrival as arrival
from kwplug.checkpoint import _commit as commit
from kwplug.checkpoint import _layout as layout
from kwplug.checkpoint import _links as links
from kwplug.checkpoint import _lock as lock
from kwplug.checkpoint import _messages as messages
from kwplug.checkpoint import _runs as runs
from kwplug.errors import CheckpointError, KwplugWarning

if TYPE_CHECKING:
    from kwplug.checkpoint._sources import CheckpointSources

CHECKPOINTS = "checkpoints"
_NAME = re.compile(r"checkpoint_(\d+)")
_TRASH = re.compile(r"\.kwplug-trash-checkpoint_\d+-\d+")


def checkpoint_name(iteration: int) -> str:
    """The folder name of save ``iteration`` (Accelerate's ``checkpoint_<iteration>``)."""
    return f"checkpoint_{iteration}"


def root(sources: CheckpointSources) -> Path:
    """``<project_dir>/checkpoints``.

    Raises:
        ValueError: ``project_dir`` is not set.
    """
    project_dir = sources.project_configuration.project_dir
    if project_dir is None:
        raise ValueError(
            "ProjectConfiguration(automatic_checkpoint_naming=True) needs a project_dir: pass "
            "Accelerator(project_dir=...) or ProjectConfiguration(project_dir=...)"
        )
    return Path(project_dir).absolute() / CHECKPOINTS


def numbered(directory: Path) -> dict[int, Path]:
    """The ``checkpoint_<n>`` folders in ``directory`` by ``n`` (whoever wrote them)."""
    found: dict[int, Path] = {}
    if directory.is_dir():
        for child in directory.iterdir():
            match = _NAME.fullmatch(child.name)
            if match and child.is_dir() and not child.is_symlink():
                found[int(match.group(1))] = child
    return found


def _only_kwplug_files(folder: Path) -> bool:
    # The lock file, kwplug's version and trash folders and its links, nothing else.
    for child in folder.iterdir():
        if child.is_symlink() and (links.is_own_link(child) or links.is_temp_link(child)):
            continue  # what the save hooks wrote, as Accelerate's checkpoint/<name>
        if child.is_symlink():
            return False
        if (child.name == layout.LOCK or runs.is_run_file(child.name)) and child.is_file():
            continue
        ours = (layout.version_number(child.name), layout.trash_number(child.name))
        if ours == (None, None) or not child.is_dir() or not commit.owned(child):
            return False
    return True


def is_kwplug_checkpoint(folder: Path) -> bool:
    """True when ``folder`` holds a complete kwplug checkpoint and only kwplug's files."""
    return commit.resolve_checkpoint(folder) is not None and _only_kwplug_files(folder)


def _skipped(sources: CheckpointSources, output_dir: str | os.PathLike[str] | None) -> Path:
    # A rank other than 0 whose save the main process made alone (it did not wait for this
    # one): nothing is written here; as Accelerate, the iteration still advances.
    config = sources.project_configuration
    if config.automatic_checkpoint_naming:
        target = root(sources) / checkpoint_name(config.iteration)
    elif output_dir is None:
        raise ValueError(
            "save_state() needs output_dir unless ProjectConfiguration("
            "automatic_checkpoint_naming=True) names the folders"
        )
    else:
        target = Path(output_dir).absolute()
    config.iteration += 1
    warnings.warn(
        f"save_state on process {sources.process_index}: the main process already saved "
        f"alone (it waited {arrival.arrival_timeout():g} s, {arrival.WAIT_VARIABLE}, for every "
        "process to call save_state), so this process's RNG states and pending accumulation "
        f"are not in {target}; call save_state on every process, or on the main one only",
        KwplugWarning,
        stacklevel=3,
    )
    return target


def _refusal(target: Path, iteration: int) -> str | None:
    if not target.exists() and not target.is_symlink():
        return None
    leftover = target.is_dir() and not target.is_symlink() and _only_kwplug_files(target)
    if leftover and commit.resolve_checkpoint(target) is None:
        return None  # what a killed save left: saved into again
    return (
        f"checkpoint directory {target} (iteration {iteration}) already exists; set "
        "project_configuration.iteration to the iteration to continue from (load_state() "
        "does so) or remove the folder"
    )


def save(sources: CheckpointSources, output_dir: str | os.PathLike[str] | None) -> Path:
    """``save_state``: into ``output_dir``, or the next ``checkpoint_<i>`` with automatic naming;
    then ``iteration += 1``, the folder is tagged with this run's id and, with
    ``total_limit``, this run's older checkpoints are pruned (:func:`prune`, main process).

    Args:
        sources: what to save (every rank calls this).
        output_dir: the checkpoint directory; ``None`` only with automatic naming, which
            ignores it otherwise (with a ``KwplugWarning``, as Accelerate ignores it silently).

    Returns:
        The checkpoint directory written.

    Raises:
        ValueError: no ``output_dir`` and no automatic naming; no ``project_dir``;
            ``checkpoint_<iteration>`` exists (other than a killed save's leftover).
        kwplug.errors.RankMismatchError: (every rank) ``sources.agree`` found a setting
            that differs between the ranks (``project_config``'s naming, ``total_limit``...).
        CheckpointError: from :func:`kwplug.checkpoint.save_state` (nothing is pruned then).
    """
    config = sources.project_configuration
    remembered = sources.arrivals.main_only
    mode = arrival.decide(sources.arrivals, sources.process_index, sources.num_processes)
    if mode == arrival.SKIPPED:
        return _skipped(sources, output_dir)
    if mode == arrival.MAIN:
        sources = attrs.evolve(sources, solo=True)
        if not remembered:
            warnings.warn(
                "save_state: not every process called it within "
                f"{arrival.arrival_timeout():g} s ({arrival.WAIT_VARIABLE}; e.g. it is called "
                "under `if accelerator.is_main_process:`), so the main process saves alone, "
                "as Accelerate's: the models, optimizers, registered objects, data positions "
                "and its own RNG states; the other processes' RNG states and pending "
                "accumulation are not saved (docs/reliability.md, 'Saving from the main "
                "process only'). This Accelerator's later saves do so at once, without waiting.",
                KwplugWarning,
                stacklevel=3,
            )
    else:  # every rank is here: settings assigned since (project_config...) must agree
        sources.agree("save_state")
    if not config.automatic_checkpoint_naming:
        if output_dir is None:
            raise ValueError(
                "save_state() needs output_dir unless ProjectConfiguration("
                "automatic_checkpoint_naming=True) names the folders"
            )
        messages.saving(output_dir)
        saved = api.save_state(sources, output_dir)
        config.iteration += 1
        return saved
    checkpoints = root(sources)
    if output_dir is not None:  # Accelerate ignores it too; say so
        warnings.warn(
            f"save_state({os.fspath(output_dir)!r}) ignores its output_dir: "
            f"automatic_checkpoint_naming saves into {checkpoints}",
            KwplugWarning,
            stacklevel=3,
        )
    target = checkpoints / checkpoint_name(config.iteration)
    refusal = _refusal(target, config.iteration) if sources.is_main_process else None
    refusal = sources.from_main(refusal)
    if refusal is not None:
        raise ValueError(refusal)
    # Tagged once the save holds the folder's lock, before its commit, so that a save killed
    # right after its commit is this run's too (tagged after it, such a newest checkpoint
    # was untagged: the restarted process, with an id of its own, then counted as a second
    # run). A tag without a complete version marks nothing: such a folder is saved into
    # again, and re-tagged.
    tagged: list[bool] = []

    def tag_in_lock() -> None:
        with contextlib.suppress(OSError):  # a full disk: the save says so; else retried
            runs.tag(target, sources.run.id)
            tagged.append(True)

    messages.saving(target)
    saved = api.save_state(sources, target, locked=tag_in_lock)
    config.iteration += 1
    if not sources.is_main_process:
        return saved
    # The save is committed: a failed tag or clean-up must not undo it.
    try:
        if not tagged:
            runs.tag(target, sources.run.id)
    except OSError as exc:
        warnings.warn(
            f"could not tag {target} with this run's id (it counts as any run's): {exc}",
            KwplugWarning,
            stacklevel=3,
        )
    if config.total_limit is None:
        return saved
    try:
        deleted = prune(checkpoints, config.total_limit, keep=target, run=sources.run.id)
        messages.deleting(len(deleted))
    except OSError as exc:
        warnings.warn(
            f"total_limit: could not delete an old checkpoint in {checkpoints}: {exc}",
            KwplugWarning,
            stacklevel=3,
        )
    return saved


def prune(
    directory: Path, total_limit: int, keep: Path | None = None, run: str | None = None
) -> list[Path]:
    """Delete the oldest kwplug checkpoints in ``directory`` beyond the newest ``total_limit``.

    Only ``checkpoint_<n>`` folders for which :func:`is_kwplug_checkpoint` holds are counted
    and deleted, oldest (smallest ``n``) first; a folder another process is saving into (its
    lock is held) is skipped, and so is ``keep``, the checkpoint just written: a run saving
    below older, higher numbers deletes those, as Accelerate does, never its own new save.
    Trash left by an interrupted prune is deleted first.

    Args:
        directory: ``<project_dir>/checkpoints``.
        total_limit: how many kwplug checkpoints to keep, >= 1.
        keep: a folder never deleted (it still counts towards ``total_limit``).
        run: only the checkpoints of this run id (and untagged ones) are counted and deleted;
            ``None``: every kwplug checkpoint.

    Returns:
        The folders deleted (their original paths).
    """
    for child in directory.iterdir():
        leftover = _TRASH.fullmatch(child.name) is not None and child.is_dir()
        if leftover and not child.is_symlink() and _only_kwplug_files(child):
            shutil.rmtree(child)
    ours = [
        f
        for _, f in sorted(numbered(directory).items())
        if is_kwplug_checkpoint(f) and (run is None or runs.owner(f) in (run, None))
    ]
    deleted: list[Path] = []
    candidates = [f for f in ours if keep is None or f != keep]
    for folder in candidates[: max(len(ours) - total_limit, 0)]:
        trash = directory / f".kwplug-trash-{folder.name}-{os.getpid()}"
        try:
            with lock.locked(folder):
                os.replace(folder, trash)  # atomic: from here on nothing reads it
        except CheckpointError:
            continue  # another process is saving into it
        commit.fsync_dir(directory)
        shutil.rmtree(trash)
        deleted.append(folder)
    return deleted


def _newest(sources: CheckpointSources, checkpoints: Path) -> tuple[str | None, str | None]:
    # On the main process: (the folder load_state() reads, a refusal). This run's newest;
    # without one, the newest of the only run there (untagged folders count as any run's).
    complete = [f for _, f in sorted(numbered(checkpoints).items()) if commit.is_complete(f)]
    owners = {f: runs.owner(f) for f in complete}
    mine = [f for f in complete if owners[f] == sources.run.id]
    others = {owners[f] for f in complete} - {None}
    if not mine and len(others) > 1:
        newest = {run: [f for f in complete if owners[f] == run][-1] for run in others}
        listed = "; ".join(f"{runs.short(r)}: newest {f.name}" for r, f in sorted(newest.items()))
        latest = next(f for f in reversed(complete) if owners[f] is not None)
        return None, (
            f"{checkpoints} holds the checkpoints of {len(others)} runs ({listed}): pass the "
            "folder to resume to load_state(), e.g. load_state("
            f"{os.fspath(latest)!r}) (that run is then continued: "
            "its checkpoints count towards total_limit)"
        )
    found = mine or complete
    return (str(found[-1]) if found else None), None


def _continued(folder: Path) -> str | None:
    # The run a load of ``folder`` continues: the one that tagged it; for an untagged folder
    # (saved before run tags), the only run with complete checkpoints next to it, if one.
    owner = runs.owner(folder)
    if owner is not None:
        return owner
    complete = [f for f in numbered(folder.parent).values() if commit.is_complete(f)]
    tagged = {runs.owner(f) for f in complete} - {None}
    return tagged.pop() if len(tagged) == 1 else None


def load(sources: CheckpointSources, input_dir: str | os.PathLike[str] | None) -> Path:
    """``load_state``: ``input_dir``, or, with automatic naming, the newest complete
    ``checkpoint_<n>`` of this run (of the only run in ``checkpoints/`` when this one has
    none); loading ``checkpoints/checkpoint_<n>`` sets ``iteration`` to ``n + 1`` and makes
    this run the run that saved it (its checkpoints are then this run's, for ``total_limit``).

    Args:
        sources: what to load into (every rank calls this).
        input_dir: the checkpoint directory, or ``None`` (automatic naming only).

    Returns:
        The version folder read.

    Raises:
        ValueError: no ``input_dir`` and no automatic naming; no ``project_dir``; no
            ``input_dir``, this run has no checkpoint and several runs' are there (the
            message names each run's newest folder).
        FileNotFoundError: no complete ``checkpoint_<n>`` (or no checkpoint at ``input_dir``).
        CheckpointError: from :func:`kwplug.checkpoint.load_state`.
    """
    config = sources.project_configuration
    if input_dir is None:
        if not config.automatic_checkpoint_naming:
            raise ValueError(
                "load_state() needs input_dir unless ProjectConfiguration("
                "automatic_checkpoint_naming=True) names the folders"
            )
        checkpoints = root(sources)
        found = _newest(sources, checkpoints) if sources.is_main_process else (None, None)
        newest, refusal = sources.from_main(found)
        if refusal is not None:
            raise ValueError(refusal)
        if newest is None:
            raise FileNotFoundError(f"no complete kwplug checkpoint_<n> folder in {checkpoints}")
        input_dir = newest
    messages.loading(input_dir)
    if commit.resolve_checkpoint(input_dir) is None and accelerate_layout.found(input_dir):
        return accelerate_layout.load_state(sources, input_dir)  # a folder Accelerate wrote
    loaded = api.load_state(sources, input_dir)
    messages.loaded(sources)
    if config.automatic_checkpoint_naming and config.project_dir is not None:
        folder = Path(input_dir).absolute()
        match = _NAME.fullmatch(folder.name)
        ours = match is not None and folder.parent == root(sources)
        owner = sources.from_main(_continued(folder) if ours and sources.is_main_process else None)
        if match and ours:
            config.iteration = int(match.group(1)) + 1
            if owner is not None:  # a resumed run is the run that saved it
                sources.run.id = owner
    return loaded

"""``save_state`` / ``load_state`` of one checkpoint directory, given a ``CheckpointSources``."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kwplug.checkpoint import _checks as checks
from kwplug.checkpoint import _codec as codec
from kwplug.checkpoint import _commit as commit
from kwplug.checkpoint import _direct as direct
from kwplug.checkpoint import _layout as layout
from kwplug.checkpoint import _links as links
from kwplug.checkpoint import _lock as lock
from kwplug.checkpoint import _manifest as manifest
from kwplug.checkpoint import _plan as plan
from kwplug.checkpoint import _prehooks as prehooks
from kwplug.checkpoint import _reader as reader
from kwplug.checkpoint import _resize as resize
from kwplug.checkpoint import _staging as staging
from kwplug.checkpoint._accumulation import PendingAccumulation
from kwplug.checkpoint._stateful import ShardedModelState, ShardedOptimizerState
from kwplug.errors import CheckpointError, KwplugWarning

if TYPE_CHECKING:
    from kwplug.checkpoint._sources import CheckpointSources


def _warn_other_folder(what: str, mine: Path, first: Path) -> None:
    warnings.warn(
        f"{what}: this process passed {mine}, process 0 passed {first}; the processes of a "
        f"run share one checkpoint, in process 0's folder, so {first} is used (pass the same "
        "folder on every process)",
        KwplugWarning,
        stacklevel=4,
    )


def _solo_entries(
    sources: CheckpointSources, entries: list[plan.Entry], directory: Path
) -> list[plan.Entry]:
    # A save by the main process alone: a sharded model's (or its optimizer's) state is
    # gathered from every rank's shards, which the other ranks, not in save_state, never send.
    for entry in entries:
        if entry.scope in ("collective", "sharded"):  # gathered, or each rank's own shards
            raise CheckpointError(
                f"save_state into {directory} on the main process alone (the other processes "
                f"did not call it): {entry.kind} ({entry.file}) is sharded (DTensor, FSDP2) "
                "and its full state is gathered from every process's shards; call save_state "
                "on every process",
                directory,
            )
    return entries


def _warn_pending_dropped(staging: Path) -> None:
    warnings.warn(
        f"save_state on the main process alone in the middle of a gradient accumulation: the "
        f"pending gradients are not saved in {staging.parent} (the other processes' are not "
        "reachable; Accelerate saves none); the resumed run starts the accumulation afresh",
        KwplugWarning,
        stacklevel=5,
    )


def _failed(exc: OSError | CheckpointError | TypeError, what: str) -> str:
    if isinstance(exc, OSError):
        return f"{what} failed: {exc.strerror or exc} ({exc.filename or what})"
    if isinstance(exc, TypeError):
        return f"{what} failed: {exc}"
    return str(exc)


def save_state(
    sources: CheckpointSources,
    output_dir: str | os.PathLike[str],
    *,
    locked: Callable[[], None] | None = None,
) -> Path:
    """Save ``sources`` into a new version folder of ``output_dir`` (every rank calls it);
    see ``Accelerator.save_state``. ``locked`` is called on the main process once it holds
    the folder's lock, before anything is staged (automatic naming tags the folder there)."""
    if not os.fspath(output_dir):
        raise ValueError("save_state needs a checkpoint directory, got an empty path")
    directory = Path(output_dir).absolute()
    entries = (
        _solo_entries(sources, plan.entries(sources), directory)
        if sources.solo
        else plan.entries(sources)
    )
    main = sources.is_main_process
    with contextlib.ExitStack() as held:
        staging: Path | None = None
        error: str | None = None
        if main:
            try:
                commit.check_directory(directory)
                commit.reached("lock")
                held.enter_context(lock.locked(directory))
                if locked is not None:
                    locked()
                staging = commit.begin(directory)
            except (OSError, CheckpointError) as exc:
                error = _failed(exc, f"saving a checkpoint into {directory}")
        shared = sources.gather((staging and str(staging), error, str(directory)))
        staging_name, error, first = shared[0]
        if error is not None:
            raise CheckpointError(error, directory)
        if first != str(directory):
            _warn_other_folder("save_state", directory, Path(first))
        staging = Path(staging_name)
        try:
            entries, error = prehooks.saving(sources, entries, staging)  # the user's save hooks
        except BaseException:  # a hook raised: nothing of this save may stay behind
            if main:
                commit.abort(staging, hooks_wrote=bool(sources.pre_hooks.save))
            raise
        records: dict[str, tuple[int, str]] = {}
        for entry in entries:
            if entry.scope == "sharded":  # every rank writes its own shards (_dcp.py)
                written, failed = entry.target.save_into(staging)  # type: ignore[attr-defined]
                records.update(written)
                error = error or failed
                continue
            if entry.scope == "main" and not main:
                continue
            state = entry.target.state_dict()  # collective entries: on every rank
            if error is not None or not (main or entry.scope == "each"):
                continue
            if entry.sparse and not state:
                continue
            if sources.solo and isinstance(entry.target, PendingAccumulation):
                _warn_pending_dropped(staging)
                continue
            try:  # written tensor by tensor, checksummed from the tensors' memory
                file = staging / entry.file
                records[entry.file] = codec.write_state(file, state, {"class": entry.kind})
            except (OSError, TypeError) as exc:
                error = f"{_failed(exc, f'writing {staging / entry.file}')}"
        shared = sources.gather((records, error))
        errors = [e for _, e in shared if e is not None]
        if main:
            try:
                if not errors:
                    written = {k: v for r, _ in shared for k, v in r.items()}
                    solo = sources.num_processes if sources.solo else None
                    records = prehooks.with_written(sources, staging, written)
                    commit.finish(staging, records, main_only=solo)
            except (OSError, CheckpointError) as exc:
                errors.append(_failed(exc, f"committing {staging}"))
            if errors:
                commit.abort(staging, hooks_wrote=bool(sources.pre_hooks.save))
            commit.reached("unlock")
        errors = [e for group in sources.gather(errors) for e in group]
    if errors:
        raise CheckpointError(
            f"saving a checkpoint into {directory} failed; the unfinished version was removed "
            f"and the previous checkpoint is intact: {errors[0]}",
            directory,
        )
    return directory


#: In place of a state in what :func:`_read` returns: decoded (and verified again) when loaded.
LATER = object()


def _held(
    entries: list[plan.Entry], lazy: set[str], records: dict[str, manifest.Record]
) -> set[str]:
    # The first of the files decoded when loaded, in load order, whose tensors together fit
    # in the largest one's size: decoded in the first pass (read and hashed once, decoded from
    # those bytes, not read again) and held until loaded, within the memory a load needs
    # anyway (one file).
    order = list(dict.fromkeys(e.file for e in entries if e.file in lazy))
    budget = max((records[name][0] for name in order), default=0)
    held: set[str] = set()
    for name in order:
        budget -= records[name][0]
        if budget < 0:
            break
        held.add(name)
    return held


def _later(entry: plan.Entry) -> bool:
    # Models, optimizers, gradients: checked from their shapes, decoded one at a time when
    # loaded (read on rank 0 only, collective entries are decoded at once: every rank waits).
    kinds = (torch.nn.Module, torch.optim.Optimizer, PendingAccumulation)
    return entry.scope != "collective" and isinstance(entry.target, kinds)


def _read(
    sources: CheckpointSources, directory: Path, entries: list[plan.Entry]
) -> tuple[dict[str, Any], dict[str, manifest.Record]]:
    """Verify every file this rank needs and check it against its object: nothing is loaded
    yet. Returns the decoded states (:data:`LATER` for those decoded when loaded), and the
    manifest's records."""
    records = manifest.read(directory)
    main = sources.is_main_process
    shards = [e for e in entries if e.scope == "sharded"]  # verified by _dcp.py
    entries = [e for e in entries if e.scope != "sharded"]
    wanted = {e.file for e in entries if e.scope != "collective" or main}
    for name in sorted(records):
        # Files save hooks wrote are the load hooks' (verified by prehooks.loading).
        own = layout.is_own_file(name) and not layout.is_rank_file(name)
        own = own and layout.sharded_prefix_of(name) is None
        if own and name not in {e.file for e in entries}:
            raise CheckpointError(
                f"{directory / name}: this run prepared no object for it (prepare the same "
                "models, optimizers and registered objects as the run that saved it)",
                directory / name,
            )
    for entry in entries:
        if entry.file not in records and not entry.optional:
            raise CheckpointError(
                f"{directory / entry.file} is missing from the checkpoint", directory / entry.file
            )
    later = {e.file for e in entries if _later(e)}
    # Files read straight into live tensors (:mod:`._direct`) are never held: they make no
    # memory when loaded, holding them would.
    straight = {e.file for e in entries if e.file in later and direct.live_state(e.target)}
    later -= _held(entries, (later - straight) & wanted & records.keys(), records)
    staging.expect(max((records[e.file][0] for e in entries if e.file in records), default=0))
    # Shard files are verified by their own entries (each rank a share), not all on rank 0.
    listed = {n for n in records if layout.is_own_file(n) and layout.sharded_prefix_of(n) is None}
    names = sorted(listed if main else wanted & records.keys())
    # Two files at a time (threads); shapes only for those decoded when loaded.
    files = [(directory / n, records[n], n in later or n not in wanted) for n in names]
    states: dict[str, Any] = dict(zip(names, reader.read_states(files), strict=True))
    modules = sources.modules()
    for entry in entries:
        if entry.file in states:
            state, meta = states[entry.file]
            states[entry.file] = (_adapted(entry.target, state, modules), meta)
            _check(directory / entry.file, entry, *states[entry.file])
    kept = {e.file for e in entries if e.file in states and e.file in wanted}
    for entry in shards:
        entry.target.verify(directory, records)  # type: ignore[attr-defined]
    return {f: LATER if f in later else states[f][0] for f in kept}, records


def _decoded(
    sources: CheckpointSources,
    directory: Path,
    records: dict[str, manifest.Record],
    entry: plan.Entry,
    read: Future[tuple[Any, dict[str, str]]] | None,
) -> Any:
    # The state of a LATER entry, decoded from its file and verified over the decoded bytes:
    # ``read``, where it is being read into the live tensors (:mod:`._direct`).
    if read is not None:
        state, meta = read.result()
    else:
        state, meta = reader.read_state(directory / entry.file, records[entry.file])
    state = _adapted(entry.target, state, sources.modules())
    _check(directory / entry.file, entry, state, meta)
    return state


def _adapted(target: Any, state: Any, modules: list[torch.nn.Module]) -> Any:
    # ``state``, read for ``target`` (an entry's object), keyed as ``target`` loads it: an
    # FSDP2 run's optimizer file into a plain optimizer (one process) and a plain run's into a
    # sharded model's optimizer (:mod:`._resize`). Anything else is returned unchanged.
    if isinstance(target, ShardedOptimizerState):
        return (
            resize.to_named_optimizer_state(state, target.optimizer, target.module)
            if state
            else state
        )
    if not isinstance(target, torch.optim.Optimizer) or not isinstance(state, dict):
        return state
    first = next((p for g in target.param_groups for p in g["params"]), None)
    owner = next((m for m in modules if any(p is first for p in m.parameters())), None)
    return resize.adapt_optimizer_state(state, target, owner)


def _check(path: Path, entry: plan.Entry, state: Any, meta: dict[str, str]) -> None:
    target = entry.target
    if isinstance(target, torch.nn.Module):
        checks.check_model(path, state, target)
    elif isinstance(target, ShardedModelState):
        checks.check_model(path, state, target.module)
    elif isinstance(target, torch.optim.Optimizer):
        checks.check_optimizer(path, state, target, meta.get("class"))
    elif isinstance(target, ShardedOptimizerState):
        checks.check_class(path, meta.get("class"), entry.kind)
    elif hasattr(target, "check"):
        target.check(state, path)


def load_state(sources: CheckpointSources, input_dir: str | os.PathLike[str]) -> Path:
    """Verify the newest complete version of ``input_dir``, then load it into ``sources``
    (every rank calls it); see ``Accelerator.load_state``."""
    if not os.fspath(input_dir):
        raise ValueError("load_state needs a checkpoint directory, got an empty path")
    directory = commit.resolve_checkpoint(input_dir)
    missing = None
    if directory is None:
        old = (Path(input_dir) / layout.MARKER).is_file()
        missing = (
            f"no complete kwplug checkpoint at {os.fspath(input_dir)!r} (a {layout.FORMAT} "
            f"version folder with a {layout.MARKER} marker)"
            + (
                ": it holds an older kwplug checkpoint of pickle files, which kwplug no "
                "longer loads"
                if old
                else ""
            )
        )
    # A run saves one checkpoint, into process 0's folder, even where each process passed
    # its own (as Accelerate's test scripts do, with one TemporaryDirectory per process):
    # a process whose folder holds none loads process 0's, which holds this process's files.
    found = sources.gather((missing, str(Path(input_dir).absolute())))
    first = Path(found[0][1])
    if missing is not None and found[0][0] is None and first != Path(input_dir).absolute():
        directory = commit.resolve_checkpoint(first)
        if directory is not None:
            missing = None
            _warn_other_folder("load_state", Path(input_dir).absolute(), first)
    # Every rank must find one (each may pass its own path): else all raise, none waits.
    absent = [(r, m) for r, m in enumerate(sources.gather(missing)) if m is not None]
    if missing is not None or directory is None:
        raise FileNotFoundError(missing)
    if absent:
        rank, message = absent[0]
        raise FileNotFoundError(
            f"rank {rank} found {message}; every process must load a checkpoint (the same "
            "one: the processes of a run load one checkpoint together)"
        )
    # Within one load, a file's private buffer is read into again by the next file once
    # what was decoded from it is no longer referenced (:mod:`._staging`).
    with staging.reusing():
        entries = plan.entries(sources)
        error: CheckpointError | None = None
        try:  # saved by another number of processes: every rank reads rank 0's file
            records = manifest.read(directory)
            if sources.is_main_process:  # a save killed before its links: point them here
                links.repair(directory.parent, directory, records)
            solo = manifest.main_only(directory)  # saved by the main process alone: rank_0 only
            entries = resize.rank_entries(entries, records, sources.num_processes, solo)
            entries = plan.match_saved(sources, entries, records)  # shards or full
            entries = prehooks.loading(sources, entries, directory)  # the user's load hooks
            states, records = _read(sources, directory, entries)
        except CheckpointError as exc:
            error = exc
        sources.raise_together(error, "another rank refused", directory)
        # Files read straight into live tensors make no memory: read two at a time, ahead.
        ahead = {
            e.file: (directory / e.file, records[e.file], live)
            for e in entries
            if states.get(e.file) is LATER and (live := direct.live_state(e.target)) is not None
        }
        with direct.reading(ahead) as reads:
            error = _load(sources, directory, entries, states, records, reads)
        sources.raise_together(error, "another rank failed to load", directory)
        return directory


def _load(
    sources: CheckpointSources,
    directory: Path,
    entries: list[plan.Entry],
    states: dict[str, Any],
    records: dict[str, manifest.Record],
    reads: dict[str, Future[tuple[Any, dict[str, str]]]],
) -> CheckpointError | None:
    # Load every verified entry in order; the first error, after which only the collective
    # entries (every rank takes part) are loaded.
    error: CheckpointError | None = None
    for entry in entries:  # verified on every rank: from here on, load
        if entry.scope == "sharded":  # a collective: every rank, even after a refusal
            try:
                entry.target.load_from(directory, records)  # type: ignore[attr-defined]
            except CheckpointError as exc:
                error = error or exc
            continue
        if not (entry.file in states or entry.scope == "collective" or entry.sparse):
            continue
        if error is not None and entry.scope != "collective":
            continue  # after a refusal, only what every rank takes part in
        state = states.pop(entry.file, {})  # held no longer than its load
        try:  # a file changed in place since it was verified is refused (_direct: copied)
            if state is LATER:
                state = _decoded(sources, directory, records, entry, reads.get(entry.file))
        except CheckpointError as exc:
            error = exc
            continue
        entry.target.load_state_dict(state)
        del state  # one file's tensors at a time
    return error

"""Atomic, resumable checkpoints: ``Accelerator.save_state`` / ``load_state``.

Layout of a checkpoint directory ``DIR``::

    model_0.pt ...        unwrapped model state dicts (rank 0)
    optimizer_0.pt ...    optimizer state dicts (rank 0)
    scaler.pt             GradScaler state (rank 0, fp16 only)
    rank_<r>.pt           per rank: RNG states (Python, NumPy, torch CPU and device), data
                          loader positions, stateful DDP communication hook states
    COMPLETE              written last: a directory without it is not a checkpoint

Every file is written under a temporary name, flushed, fsynced and renamed. A save into an
existing ``DIR`` builds ``DIR.partial`` first and swaps it in only when complete (the previous
checkpoint is kept as ``DIR.previous`` during the swap), so a crash at any point leaves a
loadable checkpoint behind: :func:`resolve_checkpoint` finds it.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MARKER = "COMPLETE"
PARTIAL_SUFFIX = ".partial"
PREVIOUS_SUFFIX = ".previous"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` to ``path`` via a fsynced temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_marker(directory: Path) -> None:
    """Write the completion marker last, durably."""
    tmp = directory / f".{MARKER}.tmp"
    with tmp.open("w") as fh:
        fh.write("kwplug checkpoint\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, directory / MARKER)
    _fsync_dir(directory)


def is_complete(directory: Path) -> bool:
    """True when ``directory`` holds a finished checkpoint."""
    return (directory / MARKER).is_file()


def resolve_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint saved as ``directory``, or ``None`` when there is none.

    Falls back to ``DIR.previous`` when a crash interrupted the swap of a new checkpoint.
    """
    path = Path(directory)
    for candidate in (path, path.with_name(path.name + PREVIOUS_SUFFIX)):
        if is_complete(candidate):
            return candidate
    return None


def staging_dir(directory: Path) -> Path:
    """Where a save into ``directory`` is built before it is swapped in."""
    return directory.with_name(directory.name + PARTIAL_SUFFIX)


def prepare_staging(directory: Path) -> Path:
    """Create an empty staging directory for ``directory`` (main process only)."""
    staging = staging_dir(directory)
    if staging.exists():
        shutil.rmtree(staging)  # left over from a crashed save
    staging.mkdir(parents=True)
    return staging


def commit(directory: Path) -> None:
    """Swap the complete staging directory in as ``directory`` (main process only)."""
    staging = staging_dir(directory)
    write_marker(staging)
    previous = directory.with_name(directory.name + PREVIOUS_SUFFIX)
    if previous.exists():
        shutil.rmtree(previous)
    if directory.exists():
        os.replace(directory, previous)
    os.replace(staging, directory)
    _fsync_dir(directory.parent)
    if previous.exists():
        shutil.rmtree(previous)


def rng_state(device: torch.device) -> dict[str, Any]:
    """RNG states of Python, NumPy (if installed), torch CPU and ``device``'s generator."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    if device.type != "cpu":
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "get_rng_state"):
            state["device"] = module.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` saved."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "device" in state:
        getattr(torch, device.type).set_rng_state(state["device"], device)


def hook_state_dict(state: Any) -> Any:
    """A picklable snapshot of a DDP communication hook's state, or ``None`` if stateless.

    States with ``state_dict()`` use it; PowerSGD's state (``__getstate__``, which leaves out
    the process group) is saved through the pickle protocol.
    """
    if state is None or isinstance(state, torch.distributed.ProcessGroup):
        return None
    if callable(getattr(state, "state_dict", None)):
        return {"kind": "state_dict", "value": state.state_dict()}
    getstate: Callable[[], Any] | None = getattr(type(state), "__getstate__", None)
    if getstate is not None and getstate is not getattr(object, "__getstate__", None):
        return {"kind": "getstate", "value": state.__getstate__()}
    return None


def load_hook_state(state: Any, saved: Any) -> None:
    """Restore a snapshot from :func:`hook_state_dict` into the live hook ``state``."""
    if saved is None:
        return
    if saved["kind"] == "state_dict":
        state.load_state_dict(saved["value"])
    else:
        process_group = getattr(state, "process_group", None)
        state.__setstate__(saved["value"])
        if process_group is not None:  # keep the live group, not the default one
            state.process_group = process_group

"""Writing one object to one file, for ``Accelerator.save`` and ``kwplug.utils.save``:
``torch.save``, or safetensors with tied tensors removed (``dedupe_shared``)."""

from __future__ import annotations

import io
import logging
import os
import pickle
from collections.abc import Mapping
from typing import Any, BinaryIO

import torch

from kwplug._process.umask import follow_umask

logger = logging.getLogger("kwplug.accelerator._saving")


def storage_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What identifies the storage ``tensor`` views: tensors with one key alias each other."""
    storage = tensor.untyped_storage()
    return (tensor.device, storage.data_ptr(), storage.nbytes())


def dedupe_shared(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` without aliases, every tensor contiguous (safetensors refuses
    tensors sharing storage): of names sharing one storage (tied weights) the first is kept,
    as Accelerate's ``clean_state_dict_for_safetensors`` does (a WARNING log naming them)."""
    seen: set[tuple[Any, ...]] = set()
    removed = []
    cleaned: dict[str, Any] = {}
    for name, tensor in state_dict.items():
        if isinstance(tensor, torch.Tensor):
            key = storage_key(tensor)
            if key in seen:
                removed.append(name)
                continue
            seen.add(key)
            tensor = tensor.contiguous()
        cleaned[name] = tensor
    if removed:
        logger.warning("Removed shared tensor(s) %s while saving (tied weights)", removed)
    return cleaned


def write(
    obj: Any,
    f: str | os.PathLike[str] | BinaryIO,
    safe_serialization: bool,
    *,
    weights_only: bool = False,
) -> None:
    """``torch.save(obj, f)``, or ``safetensors.torch.save_file`` with ``{"format": "pt"}``
    metadata (aliases removed first; ``f`` a path) -- on the calling process; the caller
    decides who writes.

    Args:
        weights_only: refuse, before writing, an object that ``torch.load(f,
            weights_only=True)`` (torch's allow-list unpickler) could not read back: what is
            written then never needs an unsafe unpickling to load.

    Raises:
        TypeError: ``weights_only`` and ``obj`` holds a type outside torch's allow-list (the
            message is torch's, naming it); safetensors with a non-path ``f``.
    """
    if safe_serialization:
        from safetensors.torch import save_file

        if not isinstance(f, (str, os.PathLike)):
            raise TypeError(f"safe_serialization=True needs a file path, got {type(f).__name__}")
        save_file(dedupe_shared(obj), os.fspath(f), metadata={"format": "pt"})
        # save_file's temporary file is 0600 whatever the umask; torch.save follows it.
        fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        try:
            follow_umask(fd)
        finally:
            os.close(fd)
        return
    if weights_only:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        try:
            torch.load(buffer, weights_only=True)
        except pickle.UnpicklingError as exc:
            lines = str(exc).splitlines()
            reason = next((ln.strip() for ln in lines if "Unpickler error" in ln), lines[0])
            raise TypeError(
                "kwplug.utils.save writes only what torch.load(weights_only=True) reads back "
                "(tensors, numbers, strings, and lists, tuples, dicts of them), so that loading "
                f"it never runs code; torch refused: {reason}"
            ) from None
        with open(f, "wb") if isinstance(f, (str, os.PathLike)) else _kept(f) as out:
            out.write(buffer.getbuffer())
        return
    torch.save(obj, f)


class _kept:
    """A caller's open file as a context manager that does not close it."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f

    def __enter__(self) -> BinaryIO:
        return self._f

    def __exit__(self, *exc: object) -> None:
        return None

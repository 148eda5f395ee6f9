"""The manifest: every file of a checkpoint with its size and sha256, written before the
completion marker, and the checks ``load_state`` runs before it touches anything."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from kwplug.checkpoint import _codec as codec
from kwplug.checkpoint import _layout as layout
from kwplug.errors import CheckpointError

#: A file's record: ``(size in bytes, sha256 hex)``.
Record = tuple[int, str]


def write(directory: Path, records: dict[str, Record]) -> None:
    """Write ``directory``'s manifest listing ``records`` (file name -> size, sha256)."""
    body = {"format": layout.FORMAT, "files": {k: list(v) for k, v in sorted(records.items())}}
    codec.write_file(directory / layout.MANIFEST, json.dumps(body, indent=1).encode())


def read(directory: Path) -> dict[str, Record]:
    """The records of ``directory``'s manifest, after checking that the directory holds
    exactly those files (plus the manifest and the marker).

    Raises:
        CheckpointError: no or malformed manifest, a file listed but missing, or a file
            present but not listed.
    """
    path = directory / layout.MANIFEST
    data = read_regular(path, limit=1 << 24)
    foreign = codec.foreign_format(data)
    if foreign is not None:
        raise CheckpointError(f"{path} is not a JSON manifest kwplug wrote: {foreign}", path)
    try:
        body = json.loads(data.decode("utf-8"))
        if body.get("format") != layout.FORMAT:
            raise ValueError(f"format {body.get('format')!r}, expected {layout.FORMAT!r}")
        records = {str(k): (int(v[0]), str(v[1])) for k, v in body["files"].items()}
    except CheckpointError:
        raise
    except UnicodeDecodeError:
        raise CheckpointError(
            f"{path} is not a JSON manifest kwplug wrote: it is not UTF-8 text", path
        ) from None
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise CheckpointError(f"{path} is not a kwplug manifest: {exc}", path) from exc
    present = files(directory) - {layout.MANIFEST, layout.MARKER}
    for name in sorted(present - records.keys()):
        raise CheckpointError(f"{directory / name} is not listed in the manifest", directory / name)
    for name in sorted(records.keys() - present):
        raise CheckpointError(
            f"{directory / name} is missing (listed in the manifest)", directory / name
        )
    return records


def files(directory: Path) -> set[str]:
    """Every entry under ``directory`` as a relative POSIX path: files, and anything not a
    plain directory (links, FIFOs) or an empty directory, which a manifest must list."""
    found: set[str] = set()
    for child in directory.iterdir():
        if child.is_dir() and not child.is_symlink():
            inner = files(child)
            found |= {f"{child.name}/{name}" for name in inner} if inner else {child.name}
        else:
            found.add(child.name)
    return found


def read_regular(path: Path, limit: int | None = None) -> bytes:
    """The bytes of ``path``, a regular file (never opened otherwise: a FIFO would hang).

    Raises:
        CheckpointError: ``path`` is missing, not a regular file, or over ``limit`` bytes.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing", path) from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path} is not a regular file", path)
    if limit is not None and os.lstat(path).st_size > limit:
        raise CheckpointError(f"{path} is larger than {limit} bytes", path)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def verified(directory: Path, records: dict[str, Record], names: Iterable[str]) -> dict[str, bytes]:
    """The bytes of the files ``names`` of ``directory``, each checked against its record.

    Raises:
        CheckpointError: a file is not in the manifest, not regular, truncated or altered.
    """
    out: dict[str, bytes] = {}
    for name in names:
        path = directory / name
        if name not in records:
            raise CheckpointError(f"{path} is not in this checkpoint", path)
        data = read_regular(path)
        size, sha = records[name]
        if len(data) != size:
            raise CheckpointError(
                f"{path} has {len(data)} bytes, the manifest says {size} (truncated?)", path
            )
        if codec.digest(data) != sha:
            raise CheckpointError(f"{path} does not match its sha256 in the manifest", path)
        out[name] = data
    return out

"""The manifest: every file of a checkpoint with its size and checksum, written before the
completion marker, and the checks ``load_state`` runs before it touches anything.

Format ``kwplug-checkpoint-3`` records each file as ``[size, "<algorithm>:<hex>"]``
(:mod:`kwplug.checkpoint._checksum`: ``xxh3-128`` when written); format
``kwplug-checkpoint-2`` as ``[size, "<sha256 hex>"]``, read as ``sha256``."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

from kwplug.checkpoint import _checksum as checksum
from kwplug.checkpoint import _codec as codec
from kwplug.checkpoint import _layout as layout
from kwplug.checkpoint import _reader as reader
from kwplug.errors import CheckpointError

#: A file's record: ``(size in bytes, "<algorithm>:<hex digest>")``.
Record = tuple[int, str]
#: The largest manifest read, in bytes.
LIMIT = 1 << 24
#: The format whose records are bare sha256 digests (read, never written).
FORMAT_2 = "kwplug-checkpoint-2"
_SHA = re.compile(r"[0-9a-f]{64}")
#: The manifest key of a save by the main process alone: the run's number of processes.
MAIN_ONLY = "main_process_only_of"


def write(directory: Path, records: dict[str, Record], *, main_only: int | None = None) -> None:
    """Write ``directory``'s manifest listing ``records`` (file name -> size, checksum); with
    ``main_only``, the number of processes of a run whose main process saved alone."""
    body: dict[str, object] = {
        "format": layout.FORMAT,
        "files": {k: list(v) for k, v in sorted(records.items())},
    }
    if main_only is not None:
        body[MAIN_ONLY] = main_only
    codec.write_file(directory / layout.MANIFEST, json.dumps(body, indent=1).encode())


def read(directory: Path) -> dict[str, Record]:
    """The records of ``directory``'s manifest, after checking that the directory holds
    exactly those files (plus the manifest and the marker).

    Raises:
        CheckpointError: no or malformed manifest, a file listed but missing, or a file
            present but not listed.
    """
    path = directory / layout.MANIFEST
    records = parse(reader.read_small(path, limit=LIMIT), path)
    present = files(directory) - {layout.MANIFEST, layout.MARKER}
    for name in sorted(present - records.keys()):
        raise CheckpointError(f"{directory / name} is not listed in the manifest", directory / name)
    for name in sorted(records.keys() - present):
        raise CheckpointError(
            f"{directory / name} is missing (listed in the manifest)", directory / name
        )
    for name in sorted(records):  # lstat: a link (to /etc...) or a FIFO is never opened
        if not stat.S_ISREG(os.lstat(directory / name).st_mode):
            raise CheckpointError(f"{directory / name} is not a regular file", directory / name)
    return records


def main_only(directory: Path) -> int | None:
    """The number of processes of the run whose main process alone saved ``directory`` (a
    save under ``if accelerator.is_main_process:``), or ``None`` for a save by every rank."""
    path = directory / layout.MANIFEST
    body = json.loads(reader.read_small(path, limit=LIMIT).decode("utf-8"))  # parsed before
    value = body.get(MAIN_ONLY)
    return value if type(value) is int and value > 0 else None


def parse(data: bytes, path: Path) -> dict[str, Record]:
    """The records in ``data``, the bytes of the manifest ``path``.

    Raises:
        CheckpointError: ``data`` is not a kwplug manifest (not JSON, too deeply nested,
            another format, ``files`` not an object of ``[size, checksum]`` pairs, a
            checksum of an algorithm kwplug does not know...).
    """
    foreign = codec.foreign_format(data, len(data))
    if foreign is not None:
        raise CheckpointError(f"{path} is not a JSON manifest kwplug wrote: {foreign}", path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(
            f"{path} is not a JSON manifest kwplug wrote: it is not UTF-8 text", path
        ) from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise CheckpointError(f"{path} is not a kwplug manifest: nested too deeply", path) from None
    except ValueError as exc:
        raise CheckpointError(f"{path} is not a kwplug manifest: {exc}", path) from None
    problem = _problem(body)
    if problem is not None:
        raise CheckpointError(f"{path} is not a kwplug manifest: {problem}", path)
    if body["format"] == FORMAT_2:  # bare sha256 digests
        return {n: (size, f"{checksum.LEGACY}:{sha}") for n, (size, sha) in body["files"].items()}
    return {name: (size, digest) for name, (size, digest) in body["files"].items()}


def _problem(body: object) -> str | None:
    # What is wrong with a decoded manifest, or None.
    if not isinstance(body, dict):
        return f"it holds a JSON {type(body).__name__}, not an object"
    if body.get("format") not in (layout.FORMAT, FORMAT_2):
        return f"format {body.get('format')!r}, expected {layout.FORMAT!r} (or {FORMAT_2!r})"
    entries = body.get("files")
    if not isinstance(entries, dict):
        return f"'files' is a JSON {type(entries).__name__}, not an object of [size, checksum]"
    legacy = body["format"] == FORMAT_2
    for name, value in entries.items():
        if not _inside(name):
            return f"it lists {name[:80]!r}, which is not a file name inside the checkpoint folder"
        ok = isinstance(value, list) and len(value) == 2
        size, digest = value if ok else (None, None)
        if not (type(size) is int and size >= 0 and isinstance(digest, str)):
            return f"the record of {name!r} is {str(value)[:80]}, not [size in bytes, checksum]"
        if legacy and not _SHA.fullmatch(digest):
            return f"the record of {name!r} is {str(value)[:80]}, not [size in bytes, sha256 hex]"
        if not legacy:
            try:
                checksum.split(digest)
            except CheckpointError as exc:  # an unknown algorithm among them, named
                return f"the record of {name!r}: {exc}"
    return None


def _inside(name: str) -> bool:
    # A relative POSIX path below the folder, as files() writes them: no absolute path, no
    # empty, "." or ".." part, no NUL (a listed "../x" would name a file elsewhere).
    return "\x00" not in name and all(part not in ("", ".", "..") for part in name.split("/"))


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

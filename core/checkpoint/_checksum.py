"""The checksum of each checkpoint file: which algorithm, written as ``"<algorithm>:<hex>"``.

New manifests record ``xxh3-128`` (the ``xxhash`` package: ~7 GB/s on one core here, against
sha256's ~0.7-1.7 GB/s), manifests of format ``kwplug-checkpoint-2`` ``sha256``; both are read.
The checksum guards against accidental damage (a truncated copy, a flipped bit, a file
swapped or appended to), not against an attacker: whoever can write the checkpoint folder can
rewrite the manifest too, so a cryptographic hash would add cost and no protection.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Protocol

import xxhash

from kwplug.errors import CheckpointError

#: The algorithm of the checksums kwplug writes.
ALGORITHM = "xxh3-128"
#: The algorithm of format ``kwplug-checkpoint-2`` manifests (a bare hex digest per file).
LEGACY = "sha256"
#: Each algorithm kwplug reads, and its digest's length in hex digits.
HEX_DIGITS = {ALGORITHM: 32, LEGACY: 64}
#: Bytes read at a time when a file is hashed without being decoded.
CHUNK = 1 << 20
_DIGEST = re.compile(r"([a-z0-9-]+):([0-9a-f]+)")


class Hasher(Protocol):
    """What ``hashlib`` and ``xxhash`` hashers share."""

    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def hasher(algorithm: str, path: Path | None = None) -> Hasher:
    """A new hasher of ``algorithm`` (``xxh3-128`` or ``sha256``).

    Raises:
        CheckpointError: kwplug knows no such algorithm (naming ``path``, the file whose
            record names it).
    """
    if algorithm == ALGORITHM:
        return xxhash.xxh3_128()
    if algorithm == LEGACY:
        return hashlib.sha256()
    raise CheckpointError(
        f"{path if path is not None else 'a manifest record'} names the checksum algorithm "
        f"{algorithm!r}; kwplug knows {', '.join(sorted(HEX_DIGITS))}",
        path,
    )


def split(digest: str) -> tuple[str, str]:
    """``(algorithm, hex)`` of a checksum ``"<algorithm>:<hex>"``.

    Raises:
        CheckpointError: ``digest`` is not of that form, or names an unknown algorithm, or
            its hex is not that algorithm's length.
    """
    found = _DIGEST.fullmatch(digest)
    if found is None:
        raise CheckpointError(f"{digest[:80]!r} is not a checksum '<algorithm>:<hex digest>'")
    algorithm, hexdigest = found.groups()
    hasher(algorithm)  # an unknown algorithm is refused by name
    if len(hexdigest) != HEX_DIGITS[algorithm]:
        raise CheckpointError(
            f"{digest[:80]!r} is not a {algorithm} checksum ({HEX_DIGITS[algorithm]} hex digits)"
        )
    return algorithm, hexdigest


def of_bytes(data: bytes, algorithm: str = ALGORITHM) -> str:
    """The checksum ``"<algorithm>:<hex>"`` of ``data`` (bytes in memory)."""
    hashed = hasher(algorithm)
    hashed.update(data)
    return f"{algorithm}:{hashed.hexdigest()}"


def of_file(fd: int, algorithm: str = ALGORITHM) -> tuple[int, str]:
    """``(bytes, "<algorithm>:<hex>")`` of what ``fd`` holds from its start, read in
    :data:`CHUNK` byte chunks into one reused buffer (``os.preadv``: the file position is
    not moved; one megabyte of memory whatever the file's size)."""
    hashed, buffer, offset = hasher(algorithm), bytearray(CHUNK), 0
    view = memoryview(buffer)
    while count := os.preadv(fd, [buffer], offset):
        hashed.update(view[:count])
        offset += count
    return offset, f"{algorithm}:{hashed.hexdigest()}"

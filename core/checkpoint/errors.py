"""The exception of the checkpoint package (to join ``kwplug.errors`` once that exists)."""

from __future__ import annotations

import os


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the message names the file and what is wrong.

    Attributes:
        file: the file or directory concerned (``str``), or ``None``.
    """

    def __init__(self, message: str, file: str | os.PathLike[str] | None = None) -> None:
        super().__init__(message)
        self.file = None if file is None else os.fspath(file)

"""The shared part of the trackers that log through an optional client package (wandb,
comet_ml, aim): the constructor, the availability check, the import naming the extra, the run
object (``tracker``) and its end (``finish``)."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any, ClassVar

from kwplug.tracking import (
    GeneralTracker,
    import_tracker_package,
    package_installed,
    plain_value,
)

__all__ = ["ClientTracker"]


class ClientTracker(GeneralTracker):
    """A tracker whose run lives in the client package ``package`` (imported only when a run
    starts), installed by ``pip install '<requirement>'``.

    A subclass sets ``name``, ``package``, ``requirement`` and ``close_method``, and defines
    ``start`` (which sets :attr:`writer`) and the logging methods; it calls :meth:`client` for
    the imported package.

    Args:
        run_name: the project name given to ``init_trackers``.
        kwargs: the tracker's ``init_kwargs``, kept as ``init_kwargs`` for :meth:`start`.
    """

    requires_logging_directory: ClassVar[bool] = False
    #: The top-level module of the client package, e.g. ``"wandb"``.
    package: ClassVar[str]
    #: The method of the run object that ends it (``"finish"``, ``"end"``, ``"close"``).
    close_method: ClassVar[str]

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        #: The client's run object (``None`` before :meth:`start` and after :meth:`finish`).
        self.writer: Any = None

    @property
    def tracker(self) -> Any:
        """The client's run object (``None`` before ``start`` and after :meth:`finish`)."""
        return self.writer

    def finish(self) -> None:
        """End the run through the client (its ``close_method``: flushes, uploads or writes
        the offline archive), once."""
        if self.writer is not None:
            getattr(self.writer, self.close_method)()
            self.writer = None

    @staticmethod
    def plain(values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` with one-element tensors as numbers (:func:`kwplug.tracking.plain_value`),
        for a client that stores Python values."""
        return {key: plain_value(value) for key, value in values.items()}

    @classmethod
    def is_available(cls) -> bool:
        """Whether the client package is installed (checked without importing it)."""
        return package_installed(cls.package)

    @classmethod
    def client(cls) -> types.ModuleType:
        """The client package, imported.

        Raises:
            ModuleNotFoundError: it is not installed (the message names
                ``pip install '<requirement>'``).
        """
        return import_tracker_package(cls.package, cls.name, cls.requirement or cls.package)

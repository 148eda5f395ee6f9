"""The shared part of the trackers that log through an optional client package (wandb,
comet_ml, aim): the constructor, the availability check and the import naming the extra."""

from __future__ import annotations

import types
from typing import Any, ClassVar

from kwplug.tracking import GeneralTracker, import_tracker_package, package_installed

__all__ = ["ClientTracker"]


class ClientTracker(GeneralTracker):
    """A tracker whose run lives in the client package ``package`` (imported only when a run
    starts), installed by ``pip install '<requirement>'``.

    A subclass sets ``name``, ``package`` and ``requirement`` and defines ``tracker``,
    ``start`` and the logging methods; it calls :meth:`client` for the imported package.

    Args:
        run_name: the project name given to ``init_trackers``.
        kwargs: the tracker's ``init_kwargs``, kept as ``init_kwargs`` for :meth:`start`.
    """

    requires_logging_directory: ClassVar[bool] = False
    #: The top-level module of the client package, e.g. ``"wandb"``.
    package: ClassVar[str]

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs

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

"""Experiment trackers: the :class:`GeneralTracker` base and how plugins contribute trackers.

A tracker records a run's configuration and metrics (TensorBoard, a JSON-lines file, an
experiment service). Trackers are plugins like every other torch-facing part of kwplug: a
plugin answers the ``trackers`` hook (:meth:`kwplug.hookspecs.HandlerSpec.trackers`) with a
mapping of tracker name to a :data:`TrackerFactory` -- usually the tracker class itself -- and
``Accelerator(log_with="name")`` selects it. kwplug's built-ins (``"tensorboard"``,
``"jsonl"``) come from :mod:`kwplug.plugins.trackers` exactly that way.

The API is Accelerate's (``accelerate.tracking.GeneralTracker``), so a tracker written for
Accelerate ports by changing its import. A factory is called as
``factory(run_name, logging_dir, **init_kwargs)`` when its ``requires_logging_directory`` is
true, else as ``factory(run_name, **init_kwargs)``; then the Accelerator calls ``start()``.
Trackers exist on the main process only (``init_trackers`` builds none elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from kwplug._additive import merge

__all__ = ["GeneralTracker", "TrackerFactory", "merge_trackers"]


class GeneralTracker:
    """Base class of a tracker (Accelerate's ``GeneralTracker`` API).

    A subclass sets the class attributes ``name`` (``str``, the name ``log_with`` and
    ``get_tracker`` use) and ``requires_logging_directory`` (``bool``), defines the
    ``tracker`` property (the underlying object, e.g. a ``SummaryWriter``), and overrides what
    it needs of :meth:`start`, :meth:`store_init_configuration`, :meth:`log` and
    :meth:`finish` (each does nothing here). It may override :meth:`is_available` when it needs
    an optional dependency, so that ``log_with="all"`` skips it when that is missing.

    Args:
        _blank: build a do-nothing placeholder without checking the subclass (what
            ``get_tracker`` returns on processes other than the main one).

    Raises:
        NotImplementedError: a subclass lacks ``name``, ``requires_logging_directory`` or
            ``tracker`` (the message lists the missing ones).
    """

    #: Accelerate's flag; kwplug runs every tracker on the main process only.
    main_process_only: ClassVar[bool] = True
    # Declared, not defined: a subclass must define them (checked in __init__).
    name: ClassVar[str]
    requires_logging_directory: ClassVar[bool]

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        required = ("name", "requires_logging_directory", "tracker")
        missing = [f"`{attr}`" for attr in required if attr not in dir(self)]
        if missing:
            raise NotImplementedError(
                f"{type(self).__name__} is missing the required tracker attribute(s) "
                f"{', '.join(missing)}; define them in the class (see "
                "kwplug.tracking.GeneralTracker)"
            )

    @classmethod
    def is_available(cls) -> bool:
        """Whether this tracker's dependencies are installed (default ``True``); trackers
        that are not available are left out of ``log_with="all"``."""
        return True

    def start(self) -> None:
        """Open the run (create writers, connect); called once by ``init_trackers`` right
        after the tracker is built, on the main process."""

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters.

        Args:
            values: name -> ``bool``, ``str``, ``int``, ``float`` or ``None``.
        """

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` for the run.

        Args:
            values: metric name -> value (``int``, ``float``, ``str``, 0-d tensors).
            step: the training step these values belong to, or ``None``.
            kwargs: tracker-specific options (``log_kwargs[name]`` of ``Accelerator.log``).
        """

    def finish(self) -> None:
        """Close the run and flush what is buffered; called by ``Accelerator.end_training``."""


#: What a plugin's ``trackers`` hook maps each name to: a callable building the tracker
#: (usually the :class:`GeneralTracker` subclass). Its ``requires_logging_directory``
#: attribute decides whether it receives the logging directory.
TrackerFactory = Callable[..., GeneralTracker]


def merge_trackers(
    contributions: list[tuple[str, Mapping[str, TrackerFactory] | None]],
) -> dict[str, TrackerFactory]:
    """Merge the plugins' ``trackers`` answers into one mapping of name to factory.

    Args:
        contributions: ``(plugin description, answer)`` pairs from the ``trackers`` hook.

    Raises:
        TypeError: an answer is not a mapping of ``str`` to a callable.
        ValueError: two plugins give the same tracker name; the message names both.
    """

    def entry(plugin: str, name: Any, factory: Any) -> tuple[TrackerFactory, str]:
        if not isinstance(name, str) or not callable(factory):
            raise TypeError(
                f"plugin {plugin!r}: trackers()[{name!r}] must map a str to a callable "
                f"tracker factory, got {type(factory).__name__}"
            )
        return factory, plugin

    return merge(
        "trackers",
        contributions,
        entry=entry,
        label="tracker name",
        kind="tracker factory",
        remedy="block one of them (KWPLUG_BLOCK_PLUGINS)",
    )

"""``get_logger``: a standard-library logger that knows about ranks (Accelerate's
``accelerate.logging``).

``from accelerate.logging import get_logger`` ports as ``from kwplug.logging import
get_logger``. Records go through :mod:`logging` as usual (handlers, formats and levels are the
application's); the adapter only decides which processes emit them and prefixes
``[RANK <i>] `` to the message, as Accelerate's does. Ranks come from the default
``torch.distributed`` process group, or torchrun's variables before one exists: no
``Accelerator`` or ``PartialState`` is needed first (Accelerate raises ``RuntimeError``
without one).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import MutableMapping
from typing import Any

from kwplug._environment import ProcessInfo

__all__ = [
    "MultiProcessAdapter",
    "get_logger",
    "get_verbosity",
    "set_verbosity",
    "set_verbosity_debug",
    "set_verbosity_error",
    "set_verbosity_info",
    "set_verbosity_warning",
]

#: The library's logger: every ``kwplug.*`` logger inherits its level.
_LIBRARY = "kwplug"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class MultiProcessAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A :class:`logging.LoggerAdapter` whose log calls take two more keywords.

    - ``main_process_only`` (``bool``, default ``True``): emit on global rank 0 only;
      ``False`` emits on every process.
    - ``in_order`` (``bool``, default ``False``): every process emits, one after the other in
      rank order (a ``torch.distributed.barrier()`` after each turn, so every process must
      make the call); ``main_process_only`` is then ignored.

    Every emitted message is prefixed with ``[RANK <process_index>] ``. The record's
    ``stacklevel`` defaults to 2, so ``%(funcName)s`` and ``%(lineno)d`` name the caller.
    """

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        """Prefix ``[RANK <i>] `` and default ``stacklevel`` to 2."""
        msg, kwargs = super().process(msg, kwargs)
        kwargs.setdefault("stacklevel", 2)
        return f"[RANK {ProcessInfo.current().rank}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        """Log ``msg % args`` at ``level`` on the processes ``main_process_only`` and
        ``in_order`` select (see the class).

        Raises:
            TypeError: ``main_process_only`` or ``in_order`` is not a ``bool``.
        """
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        for name, value in (("main_process_only", main_process_only), ("in_order", in_order)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        if not self.isEnabledFor(level):
            return
        msg, kwargs = self.process(msg, kwargs)
        if in_order:
            from kwplug.state import PartialState

            state = PartialState()  # creates the process group under torchrun if needed
            for rank in range(state.num_processes):
                if rank == state.process_index:
                    self.logger.log(level, msg, *args, **kwargs)
                state.wait_for_everyone()
        elif not main_process_only or ProcessInfo.current().rank == 0:
            self.logger.log(level, msg, *args, **kwargs)

    @functools.lru_cache(None)  # noqa: B019  (as Accelerate: one warning per distinct call)
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """:meth:`warning`, emitted once per distinct arguments (the same message logged again
        is dropped)."""
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """The :class:`MultiProcessAdapter` of ``logging.getLogger(name)``.

    Args:
        name: the logger's name (usually ``__name__``).
        log_level: a level name (``"DEBUG"``, ``"info"``...), default ``None``: the
            ``ACCELERATE_LOG_LEVEL`` environment variable, else leave the levels as they
            are. When given, it is set on this logger and on the root logger (as Accelerate).

    Raises:
        ValueError: ``log_level`` is not a level name of :mod:`logging`.
    """
    if log_level is None:
        log_level = os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        level = log_level.upper()
        if not isinstance(logging.getLevelName(level), int):
            raise ValueError(
                f"log_level must be a logging level name (DEBUG, INFO, WARNING, ERROR, "
                f"CRITICAL), got {log_level!r}"
            )
        logger.setLevel(level)
        logger.root.setLevel(level)
    return MultiProcessAdapter(logger, {})


def get_verbosity() -> int:
    """The effective level of kwplug's library logger (``logging.getLogger("kwplug")``) as an
    ``int`` (``logging.WARNING`` is 30), as Accelerate's for its ``accelerate`` logger."""
    return logging.getLogger(_LIBRARY).getEffectiveLevel()


def set_verbosity(verbosity: int | str) -> None:
    """Set the level of kwplug's library logger, which every ``kwplug.*`` logger without a
    level of its own inherits. The root logger and other libraries' loggers are untouched.

    Args:
        verbosity: a :mod:`logging` level (``int``, e.g. ``logging.INFO``) or its name, in
            any case (``"debug"``, ``"info"``, ``"warning"``, ``"error"``, ``"critical"``).

    Raises:
        TypeError: ``verbosity`` is neither an ``int`` nor a ``str`` (``bool`` included).
        ValueError: an unknown level name, naming the accepted ones.
    """
    if isinstance(verbosity, bool) or not isinstance(verbosity, int | str):
        raise TypeError(
            f"verbosity must be a logging level (int) or one of {', '.join(_LEVELS)}, "
            f"got {type(verbosity).__name__}"
        )
    if isinstance(verbosity, str):
        if verbosity.upper() not in _LEVELS:
            raise ValueError(
                f"verbosity must be one of {', '.join(_LEVELS)} (any case), got {verbosity!r}"
            )
        verbosity = verbosity.upper()
    logging.getLogger(_LIBRARY).setLevel(verbosity)


def set_verbosity_debug() -> None:
    """``set_verbosity(logging.DEBUG)``."""
    set_verbosity(logging.DEBUG)


def set_verbosity_info() -> None:
    """``set_verbosity(logging.INFO)``."""
    set_verbosity(logging.INFO)


def set_verbosity_warning() -> None:
    """``set_verbosity(logging.WARNING)``."""
    set_verbosity(logging.WARNING)


def set_verbosity_error() -> None:
    """``set_verbosity(logging.ERROR)``."""
    set_verbosity(logging.ERROR)

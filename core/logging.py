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

import logging
import os
from collections.abc import Callable

from kwplug._process.rank_logging import RankAdapter

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
#: Accelerate's library logger, which its ``set_verbosity`` sets (and so kwplug's does too).
_ACCELERATE = "accelerate"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class MultiProcessAdapter(RankAdapter):
    """A :class:`logging.LoggerAdapter` whose log calls take two more keywords.

    - ``main_process_only`` (``bool``, default ``True``): emit on global rank 0 only;
      ``False`` emits on every process.
    - ``in_order`` (``bool``, default ``False``): every process emits, one after the other in
      rank order (a ``torch.distributed.barrier()`` after each turn, so every process must
      make the call); ``main_process_only`` is then ignored.

    Every emitted message is prefixed with ``[RANK <process_index>] ``. The record's
    ``stacklevel`` defaults to 2, so ``%(funcName)s`` and ``%(lineno)d`` name the caller.
    (The behaviour is :class:`kwplug._process.rank_logging.RankAdapter`'s, which kwplug's own
    modules log through.)
    """

    def _turns(self) -> tuple[int, int, Callable[[], None]]:
        from kwplug.state import PartialState

        state = PartialState()  # creates the process group under torchrun if needed
        return state.process_index, state.num_processes, state.wait_for_everyone


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
    level of its own inherits, and of Accelerate's (``logging.getLogger("accelerate")``), which
    Accelerate's ``set_verbosity`` sets: the ``accelerate.*`` loggers of code written for it
    (``get_logger("accelerate.<name>")``) and the lines kwplug logs under Accelerate's logger
    names follow it, as after the rename they would. The root logger and other libraries'
    loggers are untouched.

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
    logging.getLogger(_ACCELERATE).setLevel(verbosity)


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

"""The rank-aware logger adapter under :mod:`kwplug.logging`, low enough for the library's
own modules to log through it (:mod:`kwplug.checkpoint` logs Accelerate's ``save_state``/
``load_state`` lines; ``kwplug.logging`` is Accelerate's module name, in the layer above the
Accelerator).

:class:`RankAdapter` is Accelerate's ``MultiProcessAdapter`` behaviour: ``main_process_only``
(default ``True``: global rank 0 emits), ``in_order``, the ``[RANK <i>] `` prefix, and
``warning_once``. :class:`kwplug.logging.MultiProcessAdapter` is this class with its
``in_order`` turns taken through ``PartialState`` (which creates the process group under
torchrun); here they are taken through the default ``torch.distributed`` group, when there is
one.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, MutableMapping
from typing import Any

import torch.distributed as dist

from kwplug._process.environment import ProcessInfo


def _no_barrier() -> None:
    """One process, or no process group: nothing to wait for."""


class RankAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A :class:`logging.LoggerAdapter` whose log calls take two more keywords.

    - ``main_process_only`` (``bool``, default ``True``): emit on global rank 0 only;
      ``False`` emits on every process.
    - ``in_order`` (``bool``, default ``False``): every process emits, one after the other in
      rank order (a barrier after each turn, so every process must make the call);
      ``main_process_only`` is then ignored.

    Every emitted message is prefixed with ``[RANK <process_index>] ``. The record's
    ``stacklevel`` defaults to 2, so ``%(funcName)s`` and ``%(lineno)d`` name the caller.
    """

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        """Prefix ``[RANK <i>] `` and default ``stacklevel`` to 2."""
        msg, kwargs = super().process(msg, kwargs)
        kwargs.setdefault("stacklevel", 2)
        return f"[RANK {ProcessInfo.current().rank}] {msg}", kwargs

    def _turns(self) -> tuple[int, int, Callable[[], None]]:
        """``in_order``'s turns: (this process's rank, the number of processes, the barrier
        after each turn): the default process group's, else one process's."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size(), dist.barrier
        return 0, 1, _no_barrier

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
            rank, size, barrier = self._turns()
            for turn in range(size):
                if turn == rank:
                    self.logger.log(level, msg, *args, **kwargs)
                barrier()
        elif not main_process_only or ProcessInfo.current().rank == 0:
            self.logger.log(level, msg, *args, **kwargs)

    @functools.lru_cache(None)  # noqa: B019  (as Accelerate: one warning per distinct call)
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """:meth:`warning`, emitted once per distinct arguments (the same message logged again
        is dropped)."""
        self.warning(*args, **kwargs)


def rank_logger(name: str) -> RankAdapter:
    """The :class:`RankAdapter` of ``logging.getLogger(name)`` (levels left as they are)."""
    return RankAdapter(logging.getLogger(name), {})

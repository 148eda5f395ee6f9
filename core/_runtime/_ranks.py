"""Accelerate's rank predicates and "which process runs what", shared by the ``Accelerator``
and :mod:`kwplug.state`'s ``PartialState`` (both derive from :class:`Ranks`), with the barrier
they wait at.

Each helper takes the number of processes and is a no-op in a single process, so that the
same training script runs under ``python`` and ``torchrun``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from kwplug._runtime._meet import meet

F = TypeVar("F", bound=Callable[..., Any])


def wait_for_everyone(num_processes: int) -> None:
    """``torch.distributed.barrier()`` when distributed; nothing otherwise.

    First every rank meets through the c10d store (:func:`kwplug._runtime._meet.meet`), so
    that a rank that never arrives is named after ``KWPLUG_RANK_WAIT`` seconds (default: the
    process group's timeout) instead of the barrier waiting out the group timeout silently;
    then ``torch.distributed.barrier()``, which every rank has reached by then.

    Raises:
        kwplug.errors.RankTimeoutError: a rank did not call it within the wait (named).
    """
    if num_processes > 1:
        if dist.is_initialized():
            meet("barrier", "wait_for_everyone", dist.get_rank(), dist.get_world_size())
        dist.barrier()


class Ranks:
    """Accelerate's rank predicates and the methods choosing which process runs what, in one
    place for the ``Accelerator`` and its ``state`` (both classes derive from this one and set
    the three attributes).

    Attributes:
        num_processes: processes in the run; process_index: this one's global rank;
            local_process_index: its rank on its node.
    """

    __slots__ = ()  # keeps the Accelerator's and the states' own attribute layout
    num_processes: int
    process_index: int
    local_process_index: int

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on local rank 0 (one process per node)."""
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        """True on the highest global rank."""
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        """True when more than one process runs."""
        return self.num_processes > 1

    # -- which process runs what (the Accelerator's and the states' methods) ------------

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """``with accelerator.main_process_first():`` (or ``state.``): rank 0 runs the block,
        then the others (e.g. download or preprocess once, then read the cache)."""
        return goes_first(self.is_main_process, self.num_processes)

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """As :meth:`main_process_first`, with local rank 0 of each node first."""
        return goes_first(self.is_local_main_process, self.num_processes)

    def on_main_process(self, function: F | None = None) -> F:
        """Decorator: ``function`` runs on global rank 0 only (elsewhere a call returns
        ``None``); in a single process it always runs.

        Raises:
            ValueError: no ``function`` (as Accelerate's, outside its own class).
        """
        return run_if(decorated(function, "on_main_process"), lambda: self.is_main_process)

    def on_local_main_process(self, function: F | None = None) -> F:
        """Decorator: ``function`` runs on local rank 0 of each node only.

        Raises:
            ValueError: no ``function``.
        """
        return run_if(
            decorated(function, "on_local_main_process"),
            lambda: self.is_local_main_process,
        )

    def on_last_process(self, function: F) -> F:
        """Decorator: ``function`` runs on the last global rank only."""
        return run_if(function, lambda: self.is_last_process)

    def on_process(self, function: F | None = None, process_index: int | None = None) -> Any:
        """Decorator: ``function`` runs on global rank ``process_index`` only; use as
        ``@accelerator.on_process(process_index=1)`` (or ``state.``).

        Raises:
            ValueError: ``process_index`` is missing.
        """
        return self._on_rank("process_index", function, process_index)

    def on_local_process(
        self, function: F | None = None, local_process_index: int | None = None
    ) -> Any:
        """Decorator: ``function`` runs on local rank ``local_process_index`` of each node.

        Raises:
            ValueError: ``local_process_index`` is missing.
        """
        return self._on_rank("local_process_index", function, local_process_index)

    def _on_rank(self, attribute: str, function: Any, index: int | None) -> Any:
        if index is None:
            raise ValueError(f"on_process needs {attribute}=<rank>")
        if function is None:
            return lambda f: self._on_rank(attribute, f, index)
        return run_if(
            function, lambda: not self.use_distributed or getattr(self, attribute) == index
        )


@contextlib.contextmanager
def goes_first(is_first: bool, num_processes: int) -> Iterator[None]:
    """The process(es) with ``is_first`` run the block, then the others (a barrier between)."""
    if not is_first:
        wait_for_everyone(num_processes)
    yield
    if is_first:
        wait_for_everyone(num_processes)


def run_if(function: F, should_run: Callable[[], bool]) -> F:
    """``function`` when ``should_run()`` at call time; otherwise a call returns ``None``."""

    @functools.wraps(function)
    def inner(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs) if should_run() else None

    return inner  # type: ignore[return-value]


def split_between_processes(
    inputs: Any, num_processes: int, process_index: int, apply_padding: bool
) -> Any:
    """This process's contiguous part of ``inputs`` (list, tuple, tensor, or a mapping of
    them, all of one length); the first ``len % num_processes`` processes get one more.

    A ``datasets.Dataset`` (any sized object with a ``select(indices)`` method, the call
    Accelerate makes) gives ``inputs.select(this process's indices)``.

    With ``apply_padding`` every part is made as long as the longest by repeating the last
    element of ``inputs``, so that the parts can be gathered (a process with nothing left
    gets only that). Other objects are returned whole.

    Raises:
        ValueError: a mapping's values have different lengths.
    """
    if num_processes == 1:
        return inputs
    if isinstance(inputs, Mapping):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) > 1:
            raise ValueError(
                f"split_between_processes needs every value of the mapping to have one length, "
                f"got {sorted(lengths)}"
            )
        length = lengths.pop() if lengths else 0
    elif isinstance(inputs, (list, tuple, torch.Tensor)) or _selectable(inputs):
        length = len(inputs)
    else:
        return inputs
    per_process, extras = divmod(length, num_processes)
    start = process_index * per_process + min(process_index, extras)
    end = start + per_process + (1 if process_index < extras else 0)
    longest = per_process + (1 if extras else 0)
    if _selectable(inputs):
        indices = list(range(start, end))
        if apply_padding and length:
            indices += [length - 1] * (longest - len(indices))
        return inputs.select(indices)

    def part(values: Any) -> Any:
        if not isinstance(values, (list, tuple, torch.Tensor)):
            return values
        piece: Any = values[start:end]
        missing = longest - len(piece) if apply_padding else 0
        if missing <= 0:
            return piece
        if isinstance(values, torch.Tensor):
            return torch.cat([piece, values[-1:].expand(missing, *values.shape[1:])])
        return piece + type(values)([values[-1]] * missing)

    if isinstance(inputs, Mapping):
        return type(inputs)({k: part(v) for k, v in inputs.items()})  # type: ignore[call-arg]
    return part(inputs)


def _selectable(inputs: Any) -> bool:
    # datasets.Dataset, without importing datasets: sized, with select(indices).
    return (
        not isinstance(inputs, (Mapping, list, tuple, torch.Tensor))
        and callable(getattr(inputs, "select", None))
        and hasattr(inputs, "__len__")
    )


def decorated(function: F | None, name: str) -> F:
    """``function``, the argument of the ``name`` decorator (``on_main_process``...).

    Raises:
        ValueError: ``function`` is ``None`` (Accelerate's signature allows the call).
    """
    if function is None:
        raise ValueError(
            f"the `{name}` decorator must be applied to a function, on an instance "
            f"(`@accelerator.{name}`)"
        )
    return function

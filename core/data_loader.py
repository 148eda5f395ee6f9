"""Accelerate's module name for the prepared data loaders: ``from accelerate.data_loader
import ...`` ports as ``from kwplug.data_loader import ...``.

The same objects as :mod:`kwplug.data` (kwplug's own name for the module), plus Accelerate's
names: ``DataLoaderShard`` (the class of a prepared data loader,
:class:`~kwplug.data.PreparedDataLoader`, so ``isinstance(loader, DataLoaderShard)`` holds as
under Accelerate), ``DataLoaderDispatcher`` (the class of a dispatched one,
:class:`~kwplug.data.DispatchedDataLoader`), and :func:`prepare_data_loader` and
:func:`skip_first_batches` with Accelerate's signatures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
import torch
from torch.utils.data import BatchSampler, DataLoader

from kwplug import data as _data
from kwplug.data import *  # noqa: F403 - every kwplug.data name, re-exported (see __all__)
from kwplug.data import DispatchedDataLoader, PreparedDataLoader, prepare_dataloader
from kwplug.validators import is_int


class _KwplugClass(type):
    """The metaclass of Accelerate's loader class names: ``isinstance``/``issubclass`` answer
    for kwplug's class (``_kwplug``), so that a loader ``prepare`` returned is a
    ``DataLoaderShard`` as under Accelerate, and calling the name builds one of kwplug's
    loaders from Accelerate's constructor arguments (``__new__`` returns it: not an instance
    of the name's own class, so no ``__init__`` runs). The names subclass kwplug's classes so
    that their members are kwplug's (``inspect``, the signature gate)."""

    _kwplug: type

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, cls._kwplug)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, cls._kwplug)


def _config(**fields: Any) -> Any:
    from kwplug.utils.dataclasses import DataLoaderConfiguration

    return DataLoaderConfiguration(**fields)


def _only_default(where: str, **values: Any) -> None:
    for name, value in values.items():
        if value not in (None, False):
            raise ValueError(f"{where}: kwplug does not support {name} (got {value!r})")


def _dropping_last(loader: PreparedDataLoader, drop_last: bool) -> PreparedDataLoader:
    # Accelerate's `_drop_last`: what its prepare passes as the user's `drop_last`.
    if not isinstance(drop_last, bool):
        raise TypeError(f"_drop_last must be a bool, got {type(drop_last).__name__}")
    if drop_last:
        loader.sharding = attrs.evolve(loader.sharding, drop_last=True)
    return loader


def _start(loader: PreparedDataLoader, skip_batches: int, iteration: int) -> PreparedDataLoader:
    if iteration:
        loader.set_epoch(iteration)
    if skip_batches:
        loader.skip_first_batches(skip_batches)
    return loader


class DataLoaderStateMixin(metaclass=_KwplugClass):
    """Accelerate's mixin of its loaders' end-of-loader state: here only a name for
    ``isinstance`` (every loader kwplug prepares has ``end_of_dataloader`` and
    ``remainder``; Accelerate's ``reset``/``begin``/``end`` are not provided)."""

    _kwplug = PreparedDataLoader


class SkipBatchSampler(BatchSampler):
    """Accelerate's: the batches of ``batch_sampler`` from batch ``skip_batches`` on, in
    every iteration.

    Args:
        batch_sampler: any iterable of batches of indices (with ``len``).
        skip_batches: ``int >= 0``, default 0.

    Raises:
        ValueError: ``skip_batches`` is negative.
    """

    def __init__(self, batch_sampler: Iterable[list[int]], skip_batches: int = 0) -> None:
        if not is_int(skip_batches) or skip_batches < 0:
            raise ValueError(
                f"SkipBatchSampler: skip_batches must be an int >= 0, got {skip_batches!r}"
            )
        # BatchSampler's own constructor validates a sampler and batch size we do not have.
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)  # type: ignore[assignment]
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))

    def __iter__(self) -> Iterator[list[int]]:
        for index, batch in enumerate(self.batch_sampler):
            if index >= self.skip_batches:
                yield batch

    @property
    def total_length(self) -> int:
        """Batches of the wrapped sampler, skipped ones included."""
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return max(self.total_length - self.skip_batches, 0)


class SkipDataLoader(PreparedDataLoader, metaclass=_KwplugClass):
    """Accelerate's: a loader over ``DataLoader(dataset, **kwargs)`` whose every iteration
    skips its first ``skip_batches`` batches (a one-process kwplug loader whose batch
    sampler is a :class:`SkipBatchSampler`; ``isinstance`` holds for any prepared loader).

    Raises:
        ValueError: ``kwargs`` give no batches (``batch_size=None``); as
            :class:`SkipBatchSampler`.
    """

    _kwplug = PreparedDataLoader

    def __new__(  # type: ignore[misc]
        cls,
        dataset: Any,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        **kwargs: Any,
    ) -> PreparedDataLoader:
        batches = DataLoader(dataset, **kwargs).batch_sampler
        if batches is None:
            raise ValueError("SkipDataLoader needs batches: batch_size=None gives none")
        rest = {k: v for k, v in kwargs.items() if k not in _BATCHING}
        return DataLoaderShard(
            dataset,
            batch_sampler=SkipBatchSampler(batches, skip_batches),
            use_stateful_dataloader=use_stateful_dataloader,
            **rest,
        )


#: DataLoader arguments a batch sampler replaces.
_BATCHING = frozenset({"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"})


class DataLoaderShard(PreparedDataLoader, metaclass=_KwplugClass):
    """Accelerate's ``DataLoaderShard``: the class of a prepared loader
    (:class:`~kwplug.data.PreparedDataLoader`; ``isinstance`` holds), and, called with
    Accelerate's arguments, a one-process prepared loader over ``DataLoader(dataset,
    **kwargs)`` (Accelerate's shards nothing itself either: its batch sampler does).

    Accelerate's arguments, as kwplug reads them:

    - ``dataset`` and ``kwargs``: ``DataLoader``'s arguments;
    - ``device``: batches are moved there (``None``, default: left in place);
    - ``rng_types``: ``None`` or ``["generator"]`` (see :func:`prepare_data_loader`);
    - ``skip_batches``: the first iteration skips that many batches (Accelerate's: every one);
    - ``use_stateful_dataloader``: a torchdata ``StatefulDataLoader``, as Accelerate's;
    - ``_drop_last``: the loader's last batch counts as dropped (``remainder`` is ``-1``), as
      Accelerate's (its ``prepare`` passes the user's ``drop_last``; kwplug's loaders also
      take it from ``drop_last`` in ``kwargs``);
    - ``_non_blocking``: asynchronous host-to-device copies;
    - ``iteration``: the epoch the loader starts at (``set_epoch``);
    - ``synchronized_generator``, ``torch_device_mesh``: only their defaults.

    Raises:
        ValueError: an unsupported argument is set.
    """

    _kwplug = PreparedDataLoader

    def __new__(  # type: ignore[misc]
        cls,
        dataset: Any,
        device: torch.device | None = None,
        rng_types: list[str] | None = None,
        synchronized_generator: torch.Generator | None = None,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        torch_device_mesh: Any = None,
        iteration: int = 0,
        **kwargs: Any,
    ) -> PreparedDataLoader:
        _check_rng_types("DataLoaderShard", rng_types)
        _only_default(
            "DataLoaderShard",
            synchronized_generator=synchronized_generator,
            torch_device_mesh=torch_device_mesh,
        )
        config = _config(
            use_stateful_dataloader=use_stateful_dataloader, non_blocking=_non_blocking
        )
        where = torch.device("cpu") if device is None else torch.device(device)
        loader = prepare_dataloader(DataLoader(dataset, **kwargs), where, 1, 0, config=config)
        return _start(_dropping_last(loader, _drop_last), skip_batches, iteration)


class DataLoaderDispatcher(DispatchedDataLoader, metaclass=_KwplugClass):
    """Accelerate's ``DataLoaderDispatcher``: the class of a loader prepared with
    ``dispatch_batches`` (:class:`~kwplug.data.DispatchedDataLoader`; ``isinstance`` holds),
    and, called with Accelerate's arguments, one over ``DataLoader(dataset, **kwargs)``
    dispatched to this run's processes (:class:`kwplug.state.PartialState`'s).

    Accelerate's arguments, as kwplug reads them: ``dataset`` and ``kwargs`` (``DataLoader``'s
    arguments); ``split_batches`` (each batch is sliced across processes, else each process
    gets one); ``skip_batches``, ``use_stateful_dataloader``, ``_non_blocking``, ``iteration``
    as :class:`DataLoaderShard`'s; ``_drop_last``: the last global batch is not completed with
    the first samples (and ``len()`` rounds down), as Accelerate's; ``slice_fn``,
    ``torch_device_mesh`` only their defaults.

    Raises:
        ValueError: an unsupported argument is set.
    """

    _kwplug = DispatchedDataLoader

    def __new__(  # type: ignore[misc]
        cls,
        dataset: Any,
        split_batches: bool = False,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        _drop_last: bool = False,
        _non_blocking: bool = False,
        slice_fn: Callable[..., Any] | None = None,
        torch_device_mesh: Any = None,
        iteration: int = 0,
        **kwargs: Any,
    ) -> PreparedDataLoader:
        from kwplug.state import PartialState

        _only_default(
            "DataLoaderDispatcher",
            slice_fn=slice_fn,
            torch_device_mesh=torch_device_mesh,
        )
        config = _config(
            split_batches=split_batches,
            dispatch_batches=True,
            use_stateful_dataloader=use_stateful_dataloader,
            non_blocking=_non_blocking,
        )
        state = PartialState()
        loader = prepare_dataloader(
            DataLoader(dataset, **kwargs),
            state.device,
            state.num_processes,
            state.process_index,
            config=config,
        )
        return _start(_dropping_last(loader, _drop_last), skip_batches, iteration)


# kwplug.data's names (its __all__ is their one list), and Accelerate's own.
__all__ = [
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "SkipBatchSampler",
    "SkipDataLoader",
    "prepare_data_loader",
]
__all__ += _data.__all__

#: The generators a prepared loader keeps equal across processes by itself.
_RNG_KEPT = frozenset({"generator"})


def prepare_data_loader(
    dataloader: DataLoader[Any],
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: list[str] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Callable[..., Any] | None = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> PreparedDataLoader:
    """Shard ``dataloader`` for one process, without an ``Accelerator`` (Accelerate's
    function): the per-rank batches of ``accelerator.prepare(dataloader)``
    (:func:`kwplug.data.prepare_dataloader`).

    Args:
        dataloader: the ``torch.utils.data.DataLoader`` to shard.
        device: where batches go with ``put_on_device`` (default: this process's device,
            :class:`kwplug.state.PartialState`'s).
        num_processes: processes to shard for (default: the run's).
        process_index: the shard this process reads (default: its global rank).
        split_batches: as the field of :class:`~kwplug.utils.DataLoaderConfiguration` (same
            default), as are the six below.
        dispatch_batches: the ``DataLoaderConfiguration`` field (same default).
        even_batches: the ``DataLoaderConfiguration`` field (same default).
        use_seedable_sampler: the ``DataLoaderConfiguration`` field (same default).
        data_seed: the ``DataLoaderConfiguration`` field (same default).
        non_blocking: the ``DataLoaderConfiguration`` field (same default).
        use_stateful_dataloader: the ``DataLoaderConfiguration`` field (same default): the
            loader returned is torchdata's ``StatefulDataLoader``.
        put_on_device: ``bool``, default ``False``; move each batch to ``device``.
        rng_types: ``None`` (default) or ``["generator"]``: a loader shuffling with a
            generator draws the same order on every process (broadcast from process 0 at each
            epoch start), whatever this says.
        slice_fn_for_dispatch: accepted as ``None`` only.
        torch_device_mesh: accepted as ``None`` only.

    Returns:
        A :class:`~kwplug.data.PreparedDataLoader` (:class:`DataLoaderDispatcher` when
        dispatched).

    Raises:
        ValueError: ``rng_types`` names another generator (synchronise it with
            :func:`kwplug.utils.synchronize_rng_states`), ``slice_fn_for_dispatch`` or
            ``torch_device_mesh`` is given, ``process_index`` is not in
            ``[0, num_processes)``; as :func:`kwplug.data.prepare_dataloader`.
        TypeError: as :class:`~kwplug.utils.DataLoaderConfiguration`.
        ImportError: ``use_stateful_dataloader=True`` without torchdata (``pip install
            torchdata``).
    """
    from kwplug.state import PartialState
    from kwplug.utils.dataclasses import DataLoaderConfiguration

    _check_rng_types("prepare_data_loader", rng_types)
    for name, value in (
        ("slice_fn_for_dispatch", slice_fn_for_dispatch),
        ("torch_device_mesh", torch_device_mesh),
    ):
        if value is not None:
            raise ValueError(f"prepare_data_loader: kwplug does not support {name} (got {value!r})")
    config = DataLoaderConfiguration(
        split_batches=split_batches,
        dispatch_batches=dispatch_batches,
        even_batches=even_batches,
        use_seedable_sampler=use_seedable_sampler,
        data_seed=data_seed,
        non_blocking=non_blocking,
        use_stateful_dataloader=use_stateful_dataloader,
    )
    if device is None or num_processes is None or process_index is None:
        state = PartialState()
        device = state.device if device is None else device
        num_processes = state.num_processes if num_processes is None else num_processes
        process_index = state.process_index if process_index is None else process_index
    if not 0 <= process_index < num_processes:
        raise ValueError(
            f"prepare_data_loader: process_index must be in [0, {num_processes}), "
            f"got {process_index}"
        )
    prepared = prepare_dataloader(
        dataloader, torch.device(device), num_processes, process_index, config=config
    )
    prepared.device_placement = put_on_device
    return prepared


def _check_rng_types(where: str, rng_types: list[str] | None) -> None:
    other = sorted(set(rng_types or ()) - _RNG_KEPT, key=str)
    if other:
        raise ValueError(
            f"{where}(rng_types={rng_types!r}): kwplug's loaders keep only the "
            "shuffling 'generator' equal across processes; synchronise the others with "
            "kwplug.utils.synchronize_rng_states before iterating"
        )

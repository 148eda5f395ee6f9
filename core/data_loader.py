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

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from kwplug import data as _data
from kwplug.data import *  # noqa: F403 - every kwplug.data name, re-exported (see __all__)
from kwplug.data import DispatchedDataLoader, PreparedDataLoader, prepare_dataloader

#: Accelerate's name of the prepared data loader class.
DataLoaderShard = PreparedDataLoader
#: Accelerate's name of the class of a loader prepared with ``dispatch_batches``.
DataLoaderDispatcher = DispatchedDataLoader

# kwplug.data's names (its __all__ is their one list), and Accelerate's own.
__all__ = ["DataLoaderDispatcher", "DataLoaderShard", "prepare_data_loader"]
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

    other = sorted(set(rng_types or ()) - _RNG_KEPT, key=str)
    if other:
        raise ValueError(
            f"prepare_data_loader(rng_types={rng_types!r}): kwplug's loaders keep only the "
            "shuffling 'generator' equal across processes; synchronise the others with "
            "kwplug.utils.synchronize_rng_states before iterating"
        )
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

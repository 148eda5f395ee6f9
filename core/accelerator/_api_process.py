"""The ``Accelerator`` methods of data loaders, distributed metrics and process control
(Accelerate's names), as a base class of the facade so that ``_facade`` stays small. Each
method delegates to :mod:`._metrics`, :mod:`._process`, :mod:`kwplug._runtime` (the rank
predicates, shared with :mod:`kwplug.state`) or :mod:`kwplug.data`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kwplug import data
from kwplug._runtime import Ranks, assigned_distributed_type, split_between_processes
from kwplug.accelerator import _metrics, _ops, _process
from kwplug.accelerator._device_map import spread_over_devices
from kwplug.accelerator._prepare import _Prepared
from kwplug.accelerator._setup import _Setup
from kwplug.utils.dataclasses import DataLoaderConfiguration, DistributedType
from kwplug.utils.memory import release_memory

_MULTI_DEVICE = frozenset(
    t for t in DistributedType if t.name.startswith("MULTI_") and t is not DistributedType.MULTI_CPU
)


class _DataAndProcessAPI(Ranks):
    """Accelerate's data-loader, metrics and process-control methods of ``Accelerator``
    (the rank predicates ``is_main_process``... from :class:`kwplug._runtime.Ranks`)."""

    _setup: _Setup
    _prepared: _Prepared
    device: torch.device
    mixed_precision: str
    _trigger: torch.Tensor | None = None

    # -- data loaders --------------------------------------------------------------------

    @property
    def dataloader_config(self) -> DataLoaderConfiguration:
        """How :meth:`prepare` shards data loaders. Settable, as in Accelerate: a new
        :class:`~kwplug.utils.DataLoaderConfiguration` applies to the loaders prepared
        afterwards (``TypeError`` for anything else)."""
        return self._prepared.dataloader_config

    @dataloader_config.setter
    def dataloader_config(self, value: DataLoaderConfiguration) -> None:
        if not isinstance(value, DataLoaderConfiguration):
            raise TypeError(
                f"dataloader_config must be a DataLoaderConfiguration, got {type(value).__name__}"
            )
        self._prepared.dataloader_config = value

    # Accelerate's read-only views of ``dataloader_config`` (``even_batches`` is settable, as
    # there: it changes the loaders prepared afterwards).
    @property
    def split_batches(self) -> bool:
        """``dataloader_config.split_batches``."""
        return self.dataloader_config.split_batches

    @property
    def dispatch_batches(self) -> bool | None:
        """``dataloader_config.dispatch_batches`` (``None``: dispatch iterable data sets)."""
        return self.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        """``dataloader_config.even_batches``; setting it checks the value (``TypeError``
        unless a ``bool``) and applies to loaders prepared afterwards."""
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        """``dataloader_config.use_seedable_sampler``."""
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        """``dataloader_config.non_blocking``."""
        return self.dataloader_config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        """``dataloader_config.use_stateful_dataloader``."""
        return self.dataloader_config.use_stateful_dataloader

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """Make the next iteration of a prepared ``dataloader`` skip its first
        ``num_batches`` batches, and return it (the same object; Accelerate returns a copy).

        That iteration draws its order as Accelerate's does, and the count *replaces* a
        position that :meth:`load_state` restored, so calling both never skips twice. After
        ``load_state`` use one of the two: iterate the loader as it is (exact resume: the rest
        of the interrupted epoch in its order), or, as Accelerate's examples do, call this
        with the batches already seen (the batches Accelerate would give).

        Raises:
            TypeError: ``dataloader`` is not a ``DataLoader`` (one kwplug did not prepare
                gets a new one-process prepared loader, :func:`kwplug.data.skip_first_batches`).
            ValueError: ``num_batches < 0``.
        """
        return data.skip_first_batches(dataloader, num_batches)

    # -- distributed metrics -------------------------------------------------------------

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """:meth:`gather` for evaluation: on the last batch of a prepared loader, the samples
        repeated to even out the last global batch are dropped, so that over an epoch the
        metric receives exactly ``len(dataset)`` samples.

        Args:
            input_data: a tensor or nested tuples/lists/dicts of tensors (first dimension:
                samples); anything else is gathered as Python objects.
            use_gather_object: gather with ``gather_object`` (lists of objects) even when
                ``input_data`` holds only tensors.
        """
        return _metrics.gather_for_metrics(
            input_data, use_gather_object, self._prepared.active_loaders
        )

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int | float = 0, pad_first: bool = False
    ) -> Any:
        """Pad each tensor of nested ``tensor`` along ``dim`` to the longest on any process
        (:func:`kwplug.utils.pad_across_processes`), so that :meth:`gather` accepts it."""
        return _metrics.pad_across_processes(tensor, dim, pad_index, pad_first)

    # -- the run -------------------------------------------------------------------------

    @property
    def distributed_type(self) -> DistributedType:
        """``NO`` (one process), ``MULTI_CPU``/``MULTI_GPU``/... (data parallel), or ``FSDP``
        when a handler declares it (class attribute ``distributed_type``) or a prepared model
        is sharded (FSDP1/FSDP2 module, ``DTensor`` parameters); else the one the
        ``select_device`` plugin declared for its device; or the value assigned to
        ``accelerator.state.distributed_type`` (as Accelerate's shared state allows: it
        changes what is reported, not how anything trains)."""
        assigned = assigned_distributed_type(self)
        if assigned is not None:
            return assigned
        return _process.distributed_type(
            self.device,
            self.num_processes,
            self._setup.handlers,
            self._prepared.models,
            self._setup.chosen.distributed_type,
        )

    @property
    def state(self) -> Any:
        """This Accelerator's :class:`kwplug.state.AcceleratorState`: ranks, device,
        ``distributed_type``, ``mixed_precision`` and the state's methods
        (``wait_for_everyone``, ``destroy_process_group``, ``print``...), as Accelerate's."""
        # The one import of the layer above (tests/gates/test_layers.py): Accelerate's state
        # class describes this Accelerator; kwplug.state imports nothing of the Accelerator.
        from kwplug.state import AcceleratorState

        return AcceleratorState._of(self)

    @property
    def multi_device(self) -> bool:
        """True when several processes train on accelerators (``distributed_type`` one of
        the ``MULTI_<device>`` types other than ``MULTI_CPU``), as in Accelerate."""
        return self.use_distributed and self.distributed_type in _MULTI_DEVICE

    @property
    def is_fsdp2(self) -> bool:
        """True when ``distributed_type`` is ``FSDP`` and no prepared model is wrapped in
        torch's FSDP1 ``FullyShardedDataParallel`` (kwplug shards through ``fully_shard``)."""
        if self.distributed_type is not DistributedType.FSDP:
            return False
        fsdp1 = getattr(getattr(torch.distributed, "fsdp", None), "FullyShardedDataParallel", ())
        return not any(isinstance(m, fsdp1) for m in self._prepared.models)

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        """:attr:`is_fsdp2`, as in Accelerate."""
        return self.is_fsdp2

    @property
    def should_save_model(self) -> bool:
        """:attr:`is_local_main_process` (Accelerate's answer without a
        ``parallelism_config``; kwplug keeps it with one)."""
        return self.is_local_main_process

    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        """``contextlib.nullcontext()``: Accelerate's context-parallel context when context
        parallelism is off, which in kwplug it always is (``ParallelismConfig(cp_size>1)`` is a
        ``ValueError``); the arguments are accepted and left alone."""
        return contextlib.nullcontext()

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """True when a submodule of ``model`` has an ``hf_device_map`` of more than one entry
        (loaded with big model inference, e.g. ``device_map="auto"``); ``prepare`` leaves such
        a model where it is, and refuses it in a run of several processes, as Accelerate."""
        return spread_over_devices(model)

    # -- which process runs what ---------------------------------------------------------

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """``with accelerator.split_between_processes(inputs) as mine:`` this process's
        contiguous part of a list, tuple, tensor or dict of them (the first
        ``len % num_processes`` processes get one more item).

        Args:
            inputs: the whole input, the same on every process.
            apply_padding: repeat the last item so that every part has the same length
                (for :meth:`gather`; drop the padding from the gathered result yourself).

        Raises:
            ValueError: a dict's values have different lengths.
        """
        yield split_between_processes(inputs, self.num_processes, self.process_index, apply_padding)

    # -- triggers and memory -------------------------------------------------------------

    def set_trigger(self) -> None:
        """Raise this process's flag; the next :meth:`check_trigger` (on every process) sees
        it (e.g. early stopping decided on one rank)."""
        self._trigger = _metrics.trigger_tensor(1, self.device)

    def check_trigger(self) -> bool:
        """True on every process when any process called :meth:`set_trigger` since the last
        check (an all-reduce; every process must call it). The flags are lowered again."""
        flag = (
            self._trigger if self._trigger is not None else _metrics.trigger_tensor(0, self.device)
        )
        if _ops.reduce(flag, self.num_processes, "sum").item() >= 1:
            self._trigger = None
            return True
        return False

    def free_memory(self, *objects: Any) -> list[None]:
        """Drop this Accelerator's references to everything it prepared, collect garbage and
        empty the device cache. Use ``a, b = accelerator.free_memory(a, b)`` to drop yours.

        Returns:
            One ``None`` per argument.
        """
        self._prepared.clear()
        self._prepared.gradient_state.restart()  # as Accelerate resets its step count
        self._trigger = None
        return release_memory(*objects)

    def clear(self, *objects: Any) -> list[None]:
        """Alias of :meth:`free_memory`."""
        return self.free_memory(*objects)

"""``PartialState`` and ``AcceleratorState``: Accelerate's names for the state of the process,
as public views of what torch already holds.

Accelerate keeps a process-wide singleton; kwplug needs none. A ``PartialState()`` reads the
ranks from the default ``torch.distributed`` process group, or from torchrun's variables
(``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``) before one exists -- and, like Accelerate's, creates
that group when torchrun started several processes and nobody has yet (through the plugins'
``init_process_group`` hook, as an ``Accelerator`` does: gloo on the CPU). Build one as often as
needed: each is a cheap view, before, alongside or after an ``Accelerator``.
``AcceleratorState()`` adds ``mixed_precision`` and the ``distributed_type`` of the live
``Accelerator`` (the most recent one still referenced; a weak reference, nothing is kept alive).

This module is a layer on top of the Accelerator: it imports what both share
(:mod:`kwplug._runtime`: the rank predicates, the live-Accelerator registry, process-group
set-up) and nothing of :mod:`kwplug.accelerator`.

``from accelerate.state import PartialState`` ports as ``from kwplug.state import
PartialState`` (also ``from kwplug import PartialState``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from kwplug._accelerate.state_gradient import GradientState
from kwplug._process.environment import ProcessInfo, end_process_group, select_device
from kwplug._runtime import (
    Ranks,
    assign_distributed_type,
    choose_device,
    forget_accelerator,
    init_process_group,
    live_accelerator,
    split_between_processes,
    wait_for_everyone,
)
from kwplug.precision import MIXED_PRECISION
from kwplug.utils.dataclasses import DistributedType, default_distributed_type

__all__ = ["AcceleratorState", "GradientState", "PartialState"]


class _SharedStateView:
    """Accelerate's ``PartialState._shared_state`` (its singleton's attributes), which code
    written for Accelerate reads to tell whether the distributed state was set up yet: ``{}``
    while no Accelerator is live (none built, or forgotten by ``_reset_state()``), else a new
    dict describing the live one (``_cpu``, ``device``, ``num_processes``, ``process_index``,
    ``local_process_index``, ``distributed_type``). Read-only: kwplug keeps no singleton, so
    writing to the dict changes nothing."""

    def __get__(self, instance: Any, owner: Any) -> dict[str, Any]:
        accelerator = live_accelerator()
        if accelerator is None:
            return {}
        return {
            "_cpu": accelerator.device.type == "cpu",
            "device": accelerator.device,
            "num_processes": accelerator.num_processes,
            "process_index": accelerator.process_index,
            "local_process_index": accelerator.local_process_index,
            "distributed_type": accelerator.distributed_type,
        }


class PartialState(Ranks):
    """The process's place in the run, without an ``Accelerator`` (Accelerate's
    ``PartialState``).

    Args:
        cpu: ``bool``, default ``False``: report (and, when it creates the process group,
            use) the CPU even when an accelerator is available; ``ACCELERATE_USE_CPU=1`` in
            the environment does the same, as in Accelerate.
        kwargs: Accelerate passes process-group options here; kwplug takes them from an
            ``InitProcessGroupKwargs`` handler, so any keyword is refused.

    Attributes:
        num_processes: ``int``, processes in the run (1 when not distributed).
        process_index: ``int``, this process's global rank.
        local_process_index: ``int``, its rank on its node.
        device: ``torch.device`` this process trains on (``LOCAL_RANK`` modulo the device
            count, made current).
        distributed_type: :class:`~kwplug.utils.DistributedType` (``NO``, ``MULTI_CPU``,
            ``MULTI_GPU``...).

    Raises:
        TypeError: ``cpu`` is not a ``bool``, or a keyword argument was given.
        ValueError: a torchrun variable is malformed.
        RuntimeError: ``WORLD_SIZE > 1``, no process group exists and no plugin created one.
    """

    _shared_state = _SharedStateView()

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        if not isinstance(cpu, bool):
            raise TypeError(f"PartialState: cpu must be a bool, got {type(cpu).__name__}")
        if kwargs:
            raise TypeError(
                f"PartialState: unexpected keyword(s) {', '.join(map(repr, kwargs))}: kwplug "
                "takes process-group options from InitProcessGroupKwargs (pass it to Accelerator)"
            )
        info = ProcessInfo.current()
        # As an Accelerator does: the plugins' select_device and init_process_group hooks,
        # through the manager an Accelerator without handlers has.
        from kwplug._plugins import discover, manager_for

        plugins = manager_for([], discover())
        chosen = choose_device(plugins, cpu, info)
        self.device: torch.device = chosen.device
        self._declared_type = chosen.distributed_type
        self._device_plugin = chosen.plugin
        if info.world_size > 1 and not dist.is_initialized():
            info = init_process_group(plugins, info, self.device.type)
        self.num_processes = info.world_size
        self.process_index = info.rank
        self.local_process_index = info.local_rank

    def __repr__(self) -> str:
        """Accelerate's block (``print(state)``), line for line: ``Distributed environment:``
        (with ``  Backend: <name>`` when a process group exists), ``Num processes:``,
        ``Process index:``, ``Local process index:``, ``Device:``."""
        backend = self.backend
        return (
            f"Distributed environment: {self.distributed_type}"
            f"{('  Backend: ' + backend) if backend else ''}\n"
            f"Num processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\n"
            f"Device: {self.device}\n"
        )

    @property
    def backend(self) -> str | None:
        """The default process group's backend (``torch.distributed.get_backend()``, e.g.
        ``"gloo"``), or ``None`` in one process, as Accelerate's."""
        if self.num_processes > 1 and dist.is_available() and dist.is_initialized():
            return str(dist.get_backend())
        return None

    @property
    def initialized(self) -> bool:
        """Always ``True``: a kwplug state exists once constructed (Accelerate's flag says
        whether its singleton was set up)."""
        return True

    @property
    def distributed_type(self) -> DistributedType:
        """What the ``select_device`` plugin declared for its device, else ``NO`` in one
        process, else data parallelism's type for the device (``MULTI_CPU``, ``MULTI_GPU``...)."""
        declared: DistributedType | None = getattr(self, "_declared_type", None)
        if declared is not None:
            return declared
        return default_distributed_type(self.device.type, self.num_processes)

    @property
    def default_device(self) -> torch.device:
        """:attr:`device`."""
        return self.device

    @property
    def fork_launched(self) -> bool:
        """``False``: kwplug's launchers start processes through torch's elastic agent."""
        return False

    def set_device(self) -> None:
        """Make :attr:`device` the current device of its type (done at construction; a
        device a ``select_device`` plugin chose is its plugin's to make current)."""
        if getattr(self, "_device_plugin", None) is not None:
            return
        select_device(self.device.type == "cpu", self.local_process_index)

    def wait_for_everyone(self) -> None:
        """``torch.distributed.barrier()`` when distributed; nothing otherwise."""
        wait_for_everyone(self.num_processes)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """``with state.split_between_processes(inputs) as mine:`` this process's contiguous
        part of a list, tuple, tensor or dict of them (as ``Accelerator``'s).

        Raises:
            ValueError: a dict's values have different lengths.
        """
        yield split_between_processes(inputs, self.num_processes, self.process_index, apply_padding)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on local rank 0 of each node (as Accelerate's ``PartialState.print``)."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Forget the live Accelerator, so that a new state no longer reports it (Accelerate
        resets its singletons). kwplug keeps no process-wide state to reset otherwise: an
        existing Accelerator keeps working, and the process group stays."""
        forget_accelerator()

    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy ``group``, or the default process group when ``None`` (after collecting
        garbage, see :func:`kwplug._process.environment.end_process_group`); nothing when none
        exists."""
        if group is None:
            end_process_group()
        elif dist.is_initialized():
            dist.destroy_process_group(group)


class AcceleratorState(PartialState):
    """:class:`PartialState` with what the live ``Accelerator`` decided (Accelerate's
    ``AcceleratorState``).

    Args:
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``None`` (default): the live
            Accelerator's, else ``ACCELERATE_MIXED_PRECISION`` from the environment, else
            ``"no"``.
        cpu: as :class:`PartialState`'s.
        kwargs: Accelerate's plugin keywords (``fsdp_plugin``, ``deepspeed_plugin``...) are
            accepted when ``None``; anything else is refused.

    Attributes:
        mixed_precision: ``str``, see above.
        distributed_type: the live Accelerator's (``FSDP`` with a sharding plugin), else
            :class:`PartialState`'s.

    Raises:
        ValueError: ``mixed_precision`` is not one of the values above, or differs from the
            live Accelerator's (as Accelerate: its state cannot be changed once set).
        TypeError: as :class:`PartialState`; a plugin keyword other than ``None``.
    """

    def __init__(
        self, mixed_precision: str | None = None, cpu: bool = False, **kwargs: Any
    ) -> None:
        unsupported = {
            k: v
            for k, v in kwargs.items()
            if k not in _PLUGIN_KEYS or (v is not None and k != "_from_accelerator")
        }
        if unsupported:
            raise TypeError(
                f"AcceleratorState: unsupported keyword(s) {', '.join(map(repr, unsupported))} "
                "(kwplug has no DeepSpeed, Megatron-LM, dynamo or tensor-parallel plugins)"
            )
        super().__init__(cpu)
        live = live_accelerator()
        if mixed_precision is not None and mixed_precision not in MIXED_PRECISION:
            raise ValueError(
                f"AcceleratorState: mixed_precision must be one of "
                f"{', '.join(map(repr, MIXED_PRECISION))} or None, got {mixed_precision!r}"
            )
        if live is not None:
            if mixed_precision is not None and mixed_precision != live.mixed_precision:
                raise ValueError(
                    f"AcceleratorState(mixed_precision={mixed_precision!r}): the live "
                    f"Accelerator uses {live.mixed_precision!r}; pass mixed_precision= to "
                    "Accelerator() instead"
                )
            self.mixed_precision: str = live.mixed_precision
        else:
            chosen = mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
            if chosen not in MIXED_PRECISION:
                raise ValueError(
                    f"ACCELERATE_MIXED_PRECISION must be one of "
                    f"{', '.join(map(repr, MIXED_PRECISION))}, got {chosen!r}"
                )
            self.mixed_precision = chosen

    @classmethod
    def _of(cls, accelerator: Any) -> AcceleratorState:
        """The state of ``accelerator`` (``accelerator.state``): its ranks, device and
        mixed precision, without reading the environment again."""
        state = cls.__new__(cls)
        state.device = accelerator.device
        state.num_processes = accelerator.num_processes
        state.process_index = accelerator.process_index
        state.local_process_index = accelerator.local_process_index
        state.mixed_precision = accelerator.mixed_precision
        state._owner = accelerator
        return state

    _owner: Any = None  # the Accelerator this state describes (None: the live one)

    def __repr__(self) -> str:
        """:class:`PartialState`'s block and ``Mixed precision type: <mixed_precision>``, as
        Accelerate's ``print(accelerator.state)``."""
        return f"{super().__repr__()}\nMixed precision type: {self.mixed_precision}\n"

    def _described(self) -> Any:
        return self._owner or live_accelerator()

    @property
    def distributed_type(self) -> DistributedType:
        """The Accelerator's ``distributed_type`` (this state's, else the live one), else
        :class:`PartialState`'s. Assignable, as on Accelerate's shared state: the value is
        what that Accelerator reports from then on (``accelerator.distributed_type``); it
        changes no training mechanism.

        Raises:
            ValueError: (on assignment) not a :class:`~kwplug.utils.DistributedType` value.
            AttributeError: (on assignment) no Accelerator is described.
        """
        live = self._described()
        if live is not None:
            return live.distributed_type  # type: ignore[no-any-return]
        return super().distributed_type

    @distributed_type.setter
    def distributed_type(self, value: DistributedType | str) -> None:
        live = self._described()
        if live is None:
            raise AttributeError(
                "AcceleratorState.distributed_type can be assigned only while an Accelerator "
                "exists (it is then what that Accelerator reports)"
            )
        assign_distributed_type(live, DistributedType(value))

    @property
    def is_fsdp2(self) -> bool:
        """The Accelerator's ``is_fsdp2`` (``False`` without one)."""
        live = self._described()
        return bool(live is not None and live.is_fsdp2)

    @property
    def fsdp_plugin(self) -> Any:
        """The Accelerator's ``fsdp_plugin`` (given as that keyword, or built from
        ``kwplug launch``'s/``accelerate launch``'s FSDP variables), as Accelerate's
        ``state.fsdp_plugin``; ``None`` without one, or when the FSDP handler was passed in
        ``kwargs_handlers`` (kwplug's own way)."""
        live = self._described()
        return None if live is None else getattr(live, "_fsdp_plugin", None)

    @property
    def parallelism_config(self) -> Any:
        """The Accelerator's ``parallelism_config`` (``None`` without one), as Accelerate's."""
        live = self._described()
        return None if live is None else getattr(live, "parallelism_config", None)

    @property
    def deepspeed_plugin(self) -> None:
        """``None``: kwplug has no DeepSpeed integration."""
        return None


_PLUGIN_KEYS = frozenset(
    {
        "dynamo_plugin",
        "deepspeed_plugin",
        "fsdp_plugin",
        "torch_tp_plugin",
        "megatron_lm_plugin",
        "parallelism_config",
        "_from_accelerator",
    }
)

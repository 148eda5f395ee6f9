"""Everything an ``Accelerator`` resolves once, at construction, into one frozen :class:`_Setup`.

Hooks are called through the Accelerator's :class:`~kwplug._plugins.KwplugPluginManager`,
which records who answered each one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from kwplug._plugins import (
    Answer,
    KwplugPluginManager,
    discover,
    manager_for,
    register_defaults,
    require_handler_list,
)
from kwplug._process.environment import ProcessInfo
from kwplug._runtime import (
    Device,
    choose_device,
    destroy_process_group_at_exit,
    init_process_group,
)
from kwplug.accelerator import _setup_cache
from kwplug.accelerator._required import require_features
from kwplug.comm_hooks import CommHook, merge_comm_hooks
from kwplug.handler import KwargsHandler
from kwplug.hookspecs import AutocastFactory
from kwplug.precision import MIXED_PRECISION, LossScaler, check_loss_scaler
from kwplug.utils.device_mesh import submesh
from kwplug.validators import shown

logger = logging.getLogger(__name__)


@attrs.frozen
class _Setup:
    """What an ``Accelerator`` resolved at construction; nothing here is looked up again.

    Attributes:
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``.
        handlers: the checked ``kwargs_handlers``.
        plugins: the plugin manager (names, descriptions, who answered).
        process: ranks, read after the process group was initialised.
        device: where this process trains.
        chosen: the ``select_device`` answer (device, declared ``distributed_type``, plugin),
            or the built-in choice.
        comm_hooks: the merged named DDP communication hooks (passed to ``wrap_model``).
        autocast_factory: builds the autocast context (``contextlib.nullcontext`` when no
            plugin answered).
        scaler: the ``make_scaler`` answer (a :class:`kwplug.precision.LossScaler`, e.g. a
            ``torch.amp.GradScaler``), or ``None``. It holds training state (the scale), so
            it belongs to one run.
        answers: who answered each set-up ``firstresult`` hook, in call order.
        device_mesh: the ``device_mesh`` hook's ``torch.distributed.device_mesh.DeviceMesh``,
            or ``None``.
        data_parallel: ``(size, rank)`` of this process along the mesh's ``dp`` dimension
            (what prepared data loaders shard over); ``(world_size, rank)`` without a mesh.
    """

    mixed_precision: str
    handlers: list[KwargsHandler]
    plugins: KwplugPluginManager
    process: ProcessInfo
    device: torch.device
    chosen: Device
    comm_hooks: dict[str, CommHook]
    autocast_factory: AutocastFactory
    scaler: LossScaler | None
    answers: Mapping[str, Answer]
    device_mesh: Any = None
    data_parallel: tuple[int, int] = (1, 0)


def resolve(
    mixed_precision: str, cpu: bool, kwargs_handlers: Sequence[KwargsHandler] | None
) -> _Setup:
    """Check the arguments, build the plugins and call every set-up hook, in the documented
    order (docs/architecture.md, "Life of an Accelerator").

    Raises:
        TypeError: the ``make_scaler`` answer is not a :class:`kwplug.precision.LossScaler`.
        ValueError: ``mixed_precision`` is not one of :data:`MIXED_PRECISION`; two handlers
            share a class; a torchrun variable is malformed.
        TypeError: ``cpu`` is not a bool; ``kwargs_handlers`` holds a non-handler; a
            ``select_device`` answer is not a ``DeviceChoice``.
        ValueError: a ``select_device`` answer's ``distributed_type`` is not a
            ``DistributedType`` value.
        RuntimeError: ``WORLD_SIZE > 1`` but no plugin initialised the process group.
        kwplug.errors.PluginConflictError: two third-party default plugins claim a
            one-answer hook for this device.
        kwplug.errors.MissingFeatureError: mixed precision, its scaler or DDP wrapping was
            asked for and no plugin provides it (see ``kwplug.accelerator._required``).
    """
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(
            f"mixed_precision must be one of {', '.join(map(repr, MIXED_PRECISION))}, "
            f"got {shown(mixed_precision)}"
        )
    if not isinstance(cpu, bool):
        raise TypeError(f"cpu must be a bool, got {type(cpu).__name__}")
    handlers = require_handler_list(kwargs_handlers)
    records = discover()
    # Read once for both keys below (a class variable: read at every construction).
    defaults = register_defaults(records)
    # A copy of the manager built for the same plugins and handler classes (no pluggy
    # inspection), with this Accelerator's own handler objects.
    plugins = manager_for(handlers, records, defaults)
    entry_key = _setup_cache.key(mixed_precision, cpu, handlers, records, defaults)
    entry = _setup_cache.lookup(entry_key, records, plugins)
    if entry is not None:
        # The same construction as a previous one: its built-in hooks' answers, replayed.
        comm_hooks = _collect_comm_hooks(plugins)  # a third-party plugin may contribute
        if comm_hooks == entry.comm_hooks:
            return _replayed(entry, mixed_precision, handlers, plugins, comm_hooks)
    before = _setup_cache.environ() if entry_key is not None else None

    info = ProcessInfo.current()
    chosen = choose_device(plugins, cpu, info)
    device = chosen.device
    plugins.check_conflicts(device.type)
    comm_hooks = _collect_comm_hooks(plugins)
    plugins.each.validate_setup(
        device_type=device.type,
        world_size=info.world_size,
        mixed_precision=mixed_precision,
        comm_hooks=comm_hooks,
    )
    if info.world_size > 1 and not dist.is_initialized():
        info = init_process_group(plugins, info, device.type)
    if info.world_size > 1:
        destroy_process_group_at_exit()
    mesh = plugins.first.device_mesh(device_type=device.type, world_size=info.world_size)

    autocast_factory: AutocastFactory = (
        plugins.first.autocast(device_type=device.type, mixed_precision=mixed_precision)
        or contextlib.nullcontext
    )
    scaler = plugins.first.make_scaler(device_type=device.type, mixed_precision=mixed_precision)
    scaling = plugins.plan["make_scaler"]  # who answered, for the check's message
    loss_scaler = check_loss_scaler(scaler, plugins.describe(scaling.plugin or ""))
    require_features(plugins, mixed_precision, info.world_size, device.type)
    logger.debug(
        "Accelerator on %s, rank %d/%d, mixed_precision=%s, plugins: %s",
        device,
        info.rank,
        info.world_size,
        mixed_precision,
        plugins.descriptions(),
    )
    _setup_cache.store(
        entry_key,
        before,
        plugins,
        _setup_cache.Entry(
            records=records,
            environ=before or {},
            info=info,
            chosen=chosen,
            comm_hooks=dict(comm_hooks),
            autocast_factory=autocast_factory,
            answers=_setup_cache.plan_entries(plugins.plan),
        ),
        replayable=info.world_size == 1 and mesh is None and loss_scaler is None,
    )
    return _Setup(
        mixed_precision=mixed_precision,
        handlers=handlers,
        plugins=plugins,
        process=info,
        device=device,
        chosen=chosen,
        comm_hooks=comm_hooks,
        autocast_factory=autocast_factory,
        scaler=loss_scaler,
        answers=dict(plugins.plan),
        device_mesh=mesh,
        data_parallel=_data_parallel(mesh, info),
    )


def _replayed(
    entry: _setup_cache.Entry,
    mixed_precision: str,
    handlers: list[KwargsHandler],
    plugins: KwplugPluginManager,
    comm_hooks: dict[str, CommHook],
) -> _Setup:
    # What resolve() returned for the construction ``entry`` was stored from: one process,
    # no mesh, no scaler; the plan as its hook calls recorded it. ``comm_hooks``: this
    # construction's own merge, equal to the entry's (a new dict: no copy needed).
    plugins.plan.update(entry.answers)
    info = entry.info
    if logger.isEnabledFor(logging.DEBUG):  # (the list of descriptions costs a microsecond)
        logger.debug(
            "Accelerator on %s, rank %d/%d, mixed_precision=%s, plugins: %s (set-up answers "
            "reused)",
            entry.chosen.device,
            info.rank,
            info.world_size,
            mixed_precision,
            plugins.descriptions(),
        )
    return _Setup(
        mixed_precision=mixed_precision,
        handlers=handlers,
        plugins=plugins,
        process=info,
        device=entry.chosen.device,
        chosen=entry.chosen,
        comm_hooks=comm_hooks,
        autocast_factory=entry.autocast_factory,
        scaler=None,
        answers=dict(plugins.plan),
        device_mesh=None,
        data_parallel=(info.world_size, info.rank),
    )


def _data_parallel(mesh: Any, info: ProcessInfo) -> tuple[int, int]:
    # The hook's one convention: ranks along "dp" read different data; a mesh without a "dp"
    # dimension (tensor parallelism only) has every rank read the same batches.
    if mesh is None:
        return info.world_size, info.rank
    try:
        dp = submesh(mesh, "dp")  # a flattened dim: torch warns on mesh["dp"]
    except (KeyError, RuntimeError, ValueError):
        return 1, 0
    return int(dp.size()), int(dp.get_local_rank())


def _collect_comm_hooks(plugins: KwplugPluginManager) -> dict[str, CommHook]:
    # Answer by answer, so that a duplicate name can be blamed on the plugin that gave it.
    answers = plugins.each.comm_hooks()
    return merge_comm_hooks([(plugins.describe(name), answer) for name, answer in answers])

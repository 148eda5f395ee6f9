"""Which device this process trains on: the plugins' ``select_device`` hook, else the built-in
choice (:func:`kwplug._process.environment.select_device`), for an ``Accelerator`` and for
:class:`kwplug.state.PartialState` alike."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import attrs
import torch

from kwplug._process.environment import ProcessInfo, select_device
from kwplug.hookspecs import DeviceChoice
from kwplug.utils.dataclasses import DistributedType
from kwplug.utils.environment import parse_flag_from_env

if TYPE_CHECKING:
    from kwplug._plugins import KwplugPluginManager


@attrs.frozen
class Device:
    """The device chosen, and the ``distributed_type`` its plugin declared.

    Attributes:
        device: where this process trains.
        distributed_type: what the run reports unless a sharding plugin says ``FSDP``
            (``None``: ``NO`` in one process, else ``MULTI_<device>``).
        plugin: the registered name of the plugin that chose it (``None``: the built-in
            choice).
    """

    device: torch.device
    distributed_type: DistributedType | None
    plugin: str | None


def choose_device(plugins: KwplugPluginManager, cpu: bool, info: ProcessInfo) -> Device:
    """Ask the plugins' ``select_device`` hook; without an answer, the built-in choice (the CPU
    when forced, else ``torch.accelerator``'s current accelerator, else the CPU; the CPU is
    ``cpu:0`` when ``world_size > 1``, as Accelerate's ``MULTI_CPU`` device).

    Args:
        plugins: the manager whose plugins are asked.
        cpu: the CPU is forced (``Accelerator(cpu=True)``); ``ACCELERATE_USE_CPU`` adds to it.
        info: the ranks from torchrun's variables (``local_rank``, ``world_size``).

    Raises:
        TypeError: the answer is not a :class:`~kwplug.hookspecs.DeviceChoice` (names the
            plugin).
        ValueError: its ``distributed_type`` is not a ``DistributedType`` value (names the
            plugin and the accepted values); ``ACCELERATE_USE_CPU`` is not a flag.
    """
    forced = cpu or parse_flag_from_env("ACCELERATE_USE_CPU")
    answer = plugins.first.select_device(
        cpu=forced, local_rank=info.local_rank, world_size=info.world_size
    )
    if answer is None:
        device = _env_device() or select_device(forced, info.local_rank)
        if device.type == "cpu" and info.world_size > 1:
            # Accelerate's MULTI_CPU device: torch.device("cpu", local_rank % 1), printed
            # "cpu:0" on every rank; one process keeps the plain "cpu", as Accelerate's NO.
            device = torch.device("cpu", 0)
        return Device(device, None, None)
    name = plugins.plan["select_device"].plugin or ""
    if not isinstance(answer, DeviceChoice):
        raise TypeError(
            f"select_device of {plugins.describe(name)} must return a kwplug.hookspecs."
            f"DeviceChoice or None, got {type(answer).__name__}"
        )
    declared = answer.distributed_type
    if declared is None:
        return Device(answer.device, None, name)
    try:
        return Device(answer.device, DistributedType(declared), name)
    except ValueError:
        accepted = ", ".join(repr(t.value) for t in DistributedType)
        raise ValueError(
            f"select_device of {plugins.describe(name)}: DeviceChoice.distributed_type must be "
            f"one of {accepted}, got {declared!r}"
        ) from None


def _env_device() -> torch.device | None:
    """Accelerate's ``ACCELERATE_TORCH_DEVICE`` (e.g. ``"cuda:1"``): the device to use as it
    is, ahead of the built-in choice (a plugin's ``select_device`` answer still wins);
    ``None`` when unset or empty.

    Raises:
        ValueError: the value is not a torch device string.
    """
    value = os.environ.get("ACCELERATE_TORCH_DEVICE")
    if not value:
        return None
    try:
        return torch.device(value)
    except RuntimeError as exc:
        raise ValueError(
            f"ACCELERATE_TORCH_DEVICE must be a torch device such as 'cuda:0', got {value!r}"
        ) from exc

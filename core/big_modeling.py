"""Accelerate's ``accelerate.big_modeling`` names that training scripts use:
:func:`init_empty_weights` and :func:`init_on_device` (a model built without memory, on
torch's ``meta`` device, before sharding or loading its weights).

and :func:`cpu_offload_with_hook` (a model on the CPU until its forward, through
:class:`kwplug.hooks.CpuOffload`). Big-model *inference* from device maps is not part of
kwplug: :func:`load_checkpoint_and_dispatch` exists, with Accelerate's signature, so that
scripts import, and raises ``NotImplementedError`` naming its row of
docs/migrating-from-accelerate.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from kwplug.hooks import CpuOffload, UserCpuOffloadHook, add_hook_to_module
from kwplug.utils.environment import parse_flag_from_env

__all__ = [
    "cpu_offload_with_hook",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
]


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Build modules without allocating their parameters: every parameter registered inside
    the block is on torch's ``meta`` device (shapes and dtypes, no storage), as Accelerate's.

    Args:
        include_buffers: also create buffers (and every other tensor a factory makes in the
            block) on ``meta``. Default ``None``: the ``ACCELERATE_INIT_INCLUDE_BUFFERS``
            variable (false when unset).

    Materialize with ``module.to_empty(device=...)`` then load weights (or
    ``load_state_dict(..., assign=True)``).
    """
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


@contextlib.contextmanager
def init_on_device(device: torch.device, include_buffers: bool | None = None) -> Iterator[None]:
    """Create the parameters registered inside the block on ``device`` (Accelerate's).

    Parameters are moved as ``nn.Module.register_parameter`` registers them (their class,
    attributes and ``requires_grad`` kept); with ``include_buffers``, torch's own device
    context (``with torch.device(device):``) makes every tensor factory allocate there,
    buffers included.

    Args:
        device: where the parameters go, e.g. ``torch.device("meta")``.
        include_buffers: see :func:`init_empty_weights`.
    """
    if include_buffers is None:
        include_buffers = parse_flag_from_env("ACCELERATE_INIT_INCLUDE_BUFFERS", False)
    if include_buffers:
        with torch.device(device):
            yield
        return
    original = torch.nn.Module.register_parameter

    def register_on_device(
        module: torch.nn.Module, name: str, param: torch.nn.Parameter | None
    ) -> None:
        original(module, name, param)
        if param is not None:
            registered = module._parameters[name]
            assert registered is not None
            attributes = dict(registered.__dict__)
            attributes["requires_grad"] = param.requires_grad
            module._parameters[name] = type(registered)(registered.to(device), **attributes)

    torch.nn.Module.register_parameter = register_on_device  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def _not_supported(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"{name}: big-model inference (device maps, CPU/disk offloading) is not part of "
        f"kwplug; see the `{name}` row of docs/migrating-from-accelerate.md "
        "(init_empty_weights and load_checkpoint_in_model without a device_map are supported)"
    )


def load_checkpoint_and_dispatch(
    model: torch.nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: str | dict[str, int | str | torch.device] | None = None,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    offload_buffers: bool = False,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> torch.nn.Module:
    """Not supported (big-model inference): Accelerate's signature, so that scripts import.

    Raises:
        NotImplementedError: always, naming the migration row.
    """
    raise _not_supported("load_checkpoint_and_dispatch")


def cpu_offload_with_hook(
    model: torch.nn.Module,
    execution_device: int | str | torch.device | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[torch.nn.Module, UserCpuOffloadHook]:
    """Keep ``model`` on the CPU until its forward, which moves it to ``execution_device``
    (default: torch's accelerator, else the CPU) where it stays until ``hook.offload()``
    (Accelerate's function, diffusers' ``enable_model_cpu_offload``): a
    :class:`kwplug.hooks.CpuOffload` appended to its hooks.

    Args:
        model: the module (moved to the CPU now).
        execution_device: where its forward runs.
        prev_module_hook: the hook this function returned for the previous model of a
            pipeline: that model is offloaded just before this one's forward.

    Returns:
        ``(model, hook)``: ``hook.offload()`` puts the model back on the CPU,
        ``hook.remove()`` detaches the hook.
    """
    hook = CpuOffload(execution_device=execution_device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)

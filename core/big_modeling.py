"""Accelerate's ``accelerate.big_modeling`` names that training scripts use:
:func:`init_empty_weights` and :func:`init_on_device` (a model built without memory, on
torch's ``meta`` device, before sharding or loading its weights).

:func:`cpu_offload_with_hook` (a model on the CPU until its forward, through
:class:`kwplug.hooks.CpuOffload`) and :func:`load_checkpoint_and_dispatch` with a device map
given as a dict (modules on devices, or on disk through kwplug's offloading hooks). Inferring
a device map (``device_map="auto"``, ``max_memory``) is not part of kwplug: a
``NotImplementedError`` naming its row of docs/migrating-from-accelerate.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kwplug.hooks import (
    AlignDevicesHook,
    CpuOffload,
    UserCpuOffloadHook,
    add_hook_to_module,
    attach_align_device_hook,
)
from kwplug.utils.environment import parse_flag_from_env
from kwplug.utils.modeling import load_checkpoint_in_model

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


def _not_supported(name: str, detail: str = "") -> NotImplementedError:
    return NotImplementedError(
        f"{name}{detail}: inferring device maps (big-model inference) is not part of kwplug; "
        f"see the `{name}` row of docs/migrating-from-accelerate.md (a device_map dict, "
        "init_empty_weights and load_checkpoint_in_model are supported)"
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
    """Load ``checkpoint`` into ``model`` (:func:`kwplug.utils.modeling.load_checkpoint_in_model`,
    with ``dtype`` and ``strict``) and, with a ``device_map`` given as a ``dict`` (submodule name
    -> device, ``"cpu"`` or ``"disk"``), place it as Accelerate's does: each submodule on its
    device with an :class:`kwplug.hooks.AlignDevicesHook` bringing its inputs there; a
    ``"disk"`` one's weights written to ``offload_folder/kwplug_offload/<name>.safetensors``
    and read from there for each forward (on ``meta`` in between, executed on the map's first
    accelerator device, else the CPU). ``model.hf_device_map`` is set; ``accelerator.save_model``
    saves the offloaded weights too.

    Raises:
        NotImplementedError: a ``device_map`` string (``"auto"``...: kwplug infers no device
            map), ``max_memory``, ``no_split_module_classes``, ``offload_state_dict``,
            ``full_state_dict=False``, ``broadcast_from_rank0`` (naming the migration row).
        ValueError: a ``"disk"`` entry without ``offload_folder``.
    """
    unsupported = {
        "device_map='...'": isinstance(device_map, str),
        "max_memory": max_memory is not None,
        "no_split_module_classes": no_split_module_classes is not None,
        "offload_state_dict": bool(offload_state_dict),
        "full_state_dict": not full_state_dict,
        "broadcast_from_rank0": broadcast_from_rank0,
    }
    for name, given in unsupported.items():
        if given:
            raise _not_supported("load_checkpoint_and_dispatch", f" ({name})")
    if isinstance(device_map, dict) and "disk" in device_map.values() and not offload_folder:
        raise ValueError("device_map puts a module on 'disk': pass an offload_folder")
    load_checkpoint_in_model(model, checkpoint, dtype=dtype, strict=strict)
    if not isinstance(device_map, dict):
        return model
    devices = [d for d in device_map.values() if d not in ("cpu", "disk")]
    main = torch.device(devices[0] if devices else "cpu")
    for name, device in device_map.items():
        module = model.get_submodule(name)
        if device == "disk":
            weights = _offload_to_disk(module, Path(offload_folder or "."), name)
        else:
            module.to(device)
            weights = None
        attach_align_device_hook(
            module,
            execution_device=main if device == "disk" else torch.device(device),
            offload=device == "disk",
            weights_map=weights,
            offload_buffers=offload_buffers,
            skip_keys=skip_keys,
            preload_module_classes=preload_module_classes,
        )
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    model.hf_device_map = dict(device_map)  # type: ignore[assignment]
    return model


class _OnDisk(Mapping[str, torch.Tensor]):
    """The tensors of one safetensors file, each read when asked for."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with safe_open(path, "pt") as f:
            self.names = list(f.keys())

    def __getitem__(self, key: str) -> torch.Tensor:
        with safe_open(self.path, "pt") as f:
            tensor: torch.Tensor = f.get_tensor(key)
            return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _offload_to_disk(module: torch.nn.Module, folder: Path, name: str) -> _OnDisk:
    # The submodule's own tensors (its names), contiguous copies in one safetensors file.
    path = folder / "kwplug_offload" / f"{name or 'model'}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in module.state_dict().items()}
    save_file(tensors, path)
    return _OnDisk(path)


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

"""Accelerator-device helpers of Accelerate 1.16's ``accelerate.utils``: which device backend
PyTorch sees, its ``torch.distributed`` backend, device names and free memory. Every answer
comes from torch (``torch.accelerator``, ``torch.distributed.Backend``)."""

from __future__ import annotations

from typing import Any

import torch

#: Backends that out-of-tree device extensions (torch_npu, Gaudi, Cambricon, ...) register with
#: torch only once imported: Accelerate's answer before that.
_EXTENSION_BACKENDS = {
    "hpu": "hccl",
    "mlu": "cncl",
    "musa": "mccl",
    "neuron": "neuron",
    "npu": "hccl",
    "sdaa": "tccl",
}

__all__ = [
    "get_accelerator_free_memory",
    "get_distributed_backend",
    "get_torch_accelerator_backend",
    "normalize_device",
]


def get_torch_accelerator_backend(check_available: bool = True) -> tuple[str | None, Any]:
    """The accelerator PyTorch would use and its API module, as Accelerate's function.

    Args:
        check_available: ``True`` (default): only a device that is available counts;
            ``False``: the build's accelerator type even when no device is present (no
            device runtime is initialised, e.g. before forking).

    Returns:
        ``(device_type, module)``, e.g. ``("cuda", torch.cuda)`` -- the module from
        ``torch.get_device_module`` -- or ``(None, None)`` without an accelerator (CPU).
        Maps to ``torch.accelerator.current_accelerator(check_available)``.
    """
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is None:
        if torch.cuda.is_available() or (not check_available and torch.version.cuda):
            return "cuda", torch.cuda
        return None, None
    try:
        device = accelerator.current_accelerator(check_available=check_available)
    except TypeError:  # torch 2.6: no check_available keyword
        device = accelerator.current_accelerator()
    except RuntimeError:  # torch 2.6 on a CPU-only build: "none is available"
        device = None
    if device is None:
        return None, None
    return device.type, torch.get_device_module(device.type)


def get_distributed_backend(device_type: str | None) -> str | None:
    """``torch.distributed``'s default backend for an accelerator ``device_type``.

    Args:
        device_type: ``"cuda"``, ``"xpu"``, ``"hpu"``, ... or ``None``.

    Returns:
        The backend name (``"nccl"`` for CUDA, ``"xccl"`` for XPU when torch has it, ...)
        from ``torch.distributed.Backend.default_device_backend_map``, where out-of-tree
        device backends (``torch_npu``, Gaudi, ...) register theirs once imported (before
        that, the backend each of them registers: ``"hccl"`` for ``"npu"``, ...); ``None``
        for ``None``, ``"cpu"`` and ``"mps"`` (as Accelerate's: gloo, their backend, is not
        an accelerator's) and unknown types.
    """
    if device_type in (None, "cpu") or not torch.distributed.is_available():
        return None
    is_xccl_available = getattr(torch.distributed, "is_xccl_available", lambda: False)
    if device_type == "xpu" and not is_xccl_available():
        return None
    registered = torch.distributed.Backend.default_device_backend_map.get(device_type)
    backend = _EXTENSION_BACKENDS.get(device_type) if registered is None else registered
    # gloo is the CPU's backend (torch maps mps to it): not an accelerator's, as Accelerate
    return None if backend is None or backend == "gloo" else str(backend)


def normalize_device(device: Any) -> Any:
    """A device argument as Accelerate normalises it before handing it to torch.

    Args:
        device: an ``int`` index, a device name or a ``torch.device``.

    Returns:
        ``"npu:0"`` for ``"npu"``; for an ``int`` index, ``"<type>:<index>"`` on an
        accelerator other than CUDA (``"hpu"`` on Gaudi), else the index as given (torch
        reads a bare index as CUDA); anything else unchanged.
    """
    if device == "npu":
        return "npu:0"
    if isinstance(device, int) and not isinstance(device, bool):
        device_type, _ = get_torch_accelerator_backend(check_available=False)
        if device_type == "hpu":
            return "hpu"
        if device_type not in (None, "cuda"):
            return f"{device_type}:{device}"
    return device


def get_accelerator_free_memory(device_module: Any, device_index: int) -> int:
    """Free memory of one device, in bytes.

    Args:
        device_module: the module :func:`get_torch_accelerator_backend` returned
            (``torch.cuda``, ``torch.xpu``, ... or ``torch.accelerator``).
        device_index: the device's index.

    Returns:
        ``device_module.mem_get_info(device_index)[0]``
        (``torch.accelerator.get_memory_info`` for the generic module).

    Raises:
        RuntimeError: from the device module, for a device that does not exist (torch's
            own error, unchanged).
    """
    if device_module is getattr(torch, "accelerator", None):
        return int(torch.accelerator.get_memory_info(device_index)[0])
    return int(device_module.mem_get_info(device_index)[0])

"""Accelerate's free functions of ``accelerate.utils.other`` that scripts call without an
``Accelerator`` at hand: :func:`wait_for_everyone`, :func:`extract_model_from_parallel`,
:func:`save`, and what they ask of a model: :func:`model_has_dtensor`, :func:`get_model_tp_size`.

Both stay below the Accelerator: the unwrapping and the live-Accelerator registry come from
:mod:`kwplug._runtime`, which the Accelerator uses too."""

from __future__ import annotations

import os
import platform
import re
import sys
from typing import Any, BinaryIO, cast

import torch

from kwplug._process.environment import ProcessInfo
from kwplug._runtime import write

__all__ = [
    "check_os_kernel",
    "extract_model_from_parallel",
    "get_model_tp_size",
    "model_has_dtensor",
    "save",
    "wait_for_everyone",
]


def wait_for_everyone() -> None:
    """Wait until every process reaches this call: ``torch.distributed.barrier()`` when a
    process group of several processes exists, nothing otherwise (as
    ``accelerator.wait_for_everyone()``)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def extract_model_from_parallel(
    model: torch.nn.Module,
    keep_fp32_wrapper: bool = True,
    keep_torch_compile: bool = True,
    recursive: bool = False,
) -> torch.nn.Module:
    """The model inside its data-parallel and plugin wrappers: what
    ``accelerator.unwrap_model`` returns, through the live Accelerator's plugins (their
    ``unwrap_model`` hook), or the built-in ones when no Accelerator exists.

    Args:
        model: a prepared (wrapped) model, or any module (returned as it is).
        keep_fp32_wrapper: ``bool``, default ``True``: keep the mixed-precision forward that
            ``prepare`` installed; ``False`` restores the model's own ``forward``.
        keep_torch_compile: ``bool``, default ``True``: keep ``torch.compile``'s wrapper.
        recursive: ``False`` only. Accelerate's ``True`` also unwraps data-parallel wrappers
            nested inside the model's submodules; kwplug's plugins wrap the model itself.

    Raises:
        TypeError: a flag is not a ``bool``, or ``model`` is not a ``torch.nn.Module``.
        ValueError: ``recursive=True``.
    """
    from kwplug._runtime import live_accelerator, unwrap

    for name, flag in (
        ("keep_fp32_wrapper", keep_fp32_wrapper),
        ("keep_torch_compile", keep_torch_compile),
        ("recursive", recursive),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if recursive:
        raise ValueError(
            "extract_model_from_parallel(recursive=True): kwplug does not unwrap wrappers "
            "nested inside submodules; its plugins wrap the prepared model itself"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"extract_model_from_parallel needs a torch.nn.Module, got {type(model).__name__}"
        )
    live: Any = live_accelerator()
    if live is not None:
        plugins = live.plugin_manager
    else:
        from kwplug._plugins import discover, manager_for

        plugins = manager_for([], discover())
    return unwrap(
        model, plugins, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile
    )


def save(
    obj: Any,
    f: str | os.PathLike[str] | BinaryIO,
    save_on_each_node: bool = False,
    safe_serialization: bool = False,
) -> None:
    """Save ``obj`` to ``f`` on the main process (Accelerate's ``accelerate.utils.save``).

    With ``safe_serialization=True``, ``safetensors.torch.save_file`` with ``{"format":
    "pt"}`` metadata (a dict of tensors; tensors sharing storage, tied weights, kept once under
    the first name with a WARNING log, as Accelerate's). Otherwise ``torch.save``, but only of
    what ``torch.load(f, weights_only=True)`` reads back, checked before writing: loading the
    file never needs to run code (Accelerate pickles anything).

    Args:
        obj: the object (a state dict, a tensor, containers of tensors and numbers).
        f: a path, or a binary file object (not with ``safe_serialization``).
        save_on_each_node: ``True``: the main process of each node writes (``LOCAL_RANK``
            0), not only global rank 0. Default ``False``.
        safe_serialization: safetensors instead of ``torch.save``. Default ``False``.

    Raises:
        TypeError: ``obj`` holds a type torch's ``weights_only`` loader refuses (named), or
            ``f`` is not a path with ``safe_serialization``.
    """
    info = ProcessInfo.current()
    if (info.local_rank if save_on_each_node else info.rank) == 0:
        write(obj, f, safe_serialization, weights_only=True)


_MIN_KERNEL = (5, 5, 0)


def check_os_kernel() -> None:
    """Warn (on the main process, logger ``kwplug.utils.other``) when this is Linux with a
    kernel older than 5.5.0, which can make processes hang (Accelerate's check; issue
    huggingface/accelerate#1929). Nothing on other systems or an unparsable release
    (``platform.uname()``)."""
    from kwplug._process.rank_logging import rank_logger

    info = platform.uname()
    if info.system != "Linux":
        return
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", info.release)
    if match is None:
        return
    if tuple(int(part) for part in match.groups()) < _MIN_KERNEL:
        minimum = ".".join(map(str, _MIN_KERNEL))
        rank_logger(__name__).warning(
            f"Detected kernel version {match.group()}, which is below the recommended minimum "
            f"of {minimum}; this can cause the process to hang. It is recommended to upgrade "
            "the kernel to the minimum version or higher."
        )


def model_has_dtensor(model: torch.nn.Module) -> bool:
    """Whether a parameter of ``model`` is a ``torch.distributed.tensor.DTensor`` (sharded by
    ``fully_shard``/``parallelize_module``), Accelerate's function.

    ``False`` on a torch built without distributed support, and without importing
    ``torch.distributed.tensor`` (which such a build cannot): no parameter is a ``DTensor``
    unless that module was imported.
    """
    if not torch.distributed.is_available():
        return False
    tensor_module = sys.modules.get("torch.distributed.tensor")
    if tensor_module is None:
        return False
    return any(isinstance(p, tensor_module.DTensor) for p in model.parameters())


def get_model_tp_size(model: torch.nn.Module) -> int | None:
    """The tensor-parallel degree a transformers model was sharded with, ``None`` if not
    (Accelerate's function): ``model.tp_size`` (transformers < 5), else
    ``model.config.distributed_config.tp_size`` (transformers >= 5; a ``dict`` config too)."""
    tp_size = getattr(model, "tp_size", None)
    if tp_size is not None:
        return cast(int, tp_size)
    distributed = getattr(getattr(model, "config", None), "distributed_config", None)
    if isinstance(distributed, dict):
        return distributed.get("tp_size")
    return getattr(distributed, "tp_size", None)

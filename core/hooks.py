"""Accelerate's ``accelerate.hooks`` names scripts import: the forward hooks of big-model
inference (device alignment, offloading), which kwplug does not have.

:func:`attach_align_device_hook` and :func:`remove_hook_from_module` exist with Accelerate's
signatures, so that a script imports, and raise ``NotImplementedError`` naming their row of
docs/migrating-from-accelerate.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["attach_align_device_hook", "remove_hook_from_module"]


def _not_supported(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"{name}: Accelerate's big-model inference hooks (device alignment, offloading) are "
        f"not part of kwplug; see the `{name}` row of docs/migrating-from-accelerate.md"
    )


def attach_align_device_hook(
    module: torch.nn.Module,
    execution_device: torch.device | None = None,
    offload: bool = False,
    weights_map: Mapping[str, Any] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict[int, dict[torch.device, torch.Tensor]] | None = None,
) -> None:
    """Not supported: Accelerate's signature, so that scripts import.

    Raises:
        NotImplementedError: always, naming the migration row.
    """
    raise _not_supported("attach_align_device_hook")


def remove_hook_from_module(module: torch.nn.Module, recurse: bool = False) -> torch.nn.Module:
    """Not supported: Accelerate's signature, so that scripts import.

    Raises:
        NotImplementedError: always, naming the migration row.
    """
    raise _not_supported("remove_hook_from_module")

"""The model inside its wrappers: torch's (DDP, DataParallel, ``torch.compile``), then the
plugins' ``unwrap_model`` hook, and the mixed-precision forward ``prepare`` installed.

``Accelerator.unwrap_model`` (and ``get_state_dict``/``save_model``) and
:func:`kwplug.utils.extract_model_from_parallel` both unwrap through :func:`unwrap`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from kwplug._runtime._forward import remove_mixed_precision

if TYPE_CHECKING:
    from kwplug._plugins import KwplugPluginManager


def compiled_inner(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module inside torch.compile's ``OptimizedModule`` (duck-typed); ``None`` for any
    other module."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None


def peel(model: torch.nn.Module, plugins: KwplugPluginManager) -> torch.nn.Module:
    """One wrapper less: torch's own (DDP, DataParallel, ``torch.compile``) here, any other
    through the plugins' ``unwrap_model`` hook; ``model`` itself when nothing unwraps it."""
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return cast(torch.nn.Module, model.module)
    compiled = compiled_inner(model)
    if compiled is not None:
        return compiled
    answer = next((a for _, a in plugins.each.unwrap_model(model=model) if a is not None), None)
    if answer is None:
        return model
    if not isinstance(answer, torch.nn.Module):
        raise TypeError(f"hook unwrap_model returned {type(answer).__name__}, not a Module")
    return answer


def unwrap(
    model: torch.nn.Module,
    plugins: KwplugPluginManager,
    keep_fp32_wrapper: bool = True,
    keep_torch_compile: bool = False,
) -> torch.nn.Module:
    """Peel every wrapper off ``model`` until nothing unwraps (see :func:`peel`).

    ``keep_fp32_wrapper=False`` removes the mixed-precision forward ``prepare`` installed.
    ``keep_torch_compile=True`` (``Accelerator.unwrap_model``'s default, as Accelerate's)
    keeps ``torch.compile``'s wrapper: a compiled module inside other wrappers is returned as
    it is; an outermost one comes back around the unwrapped module -- itself when it already
    wraps that module, else a new ``OptimizedModule`` with the same dynamo context (Accelerate
    reassigns the prepared one's ``_orig_mod`` instead, which takes DDP out of the model
    still being trained).
    """
    outer = model if keep_torch_compile else None
    first = compiled_inner(model) if keep_torch_compile else None
    if first is not None:
        model = first
    while not (keep_torch_compile and compiled_inner(model) is not None):
        inner = peel(model, plugins)
        if inner is model:
            break
        model = inner
    if not keep_fp32_wrapper:
        remove_mixed_precision(model)
        compiled = compiled_inner(model)
        if compiled is not None:  # a compiled module kept: the patch may be on either
            remove_mixed_precision(compiled)
    if outer is None or first is None:
        return model
    if first is model:
        return outer
    rewrapped: torch.nn.Module = type(outer)(model, outer.dynamo_ctx)
    return rewrapped

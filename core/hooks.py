"""Accelerate's ``accelerate.hooks``: forward hooks that see the keyword arguments
(:class:`ModelHook`, :class:`SequentialHook`, :func:`add_hook_to_module`,
:func:`remove_hook_from_module`), as Accelerate's; transformers and PEFT attach them.

The hooks of big-model inference built on them (device alignment, offloading) are not part of
kwplug: :func:`attach_align_device_hook` exists with Accelerate's signature, so that a script
imports, and raises ``NotImplementedError`` naming its row of docs/migrating-from-accelerate.md.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, cast

import torch

__all__ = [
    "ModelHook",
    "SequentialHook",
    "add_hook_to_module",
    "attach_align_device_hook",
    "remove_hook_from_module",
]


class ModelHook:
    """Callbacks around a module's ``forward`` (Accelerate's ``ModelHook``): unlike torch's
    forward hooks, :meth:`pre_forward` gets and returns the keyword arguments too.

    Attributes:
        no_grad: class attribute, default ``False``: run the module's own ``forward`` under
            ``torch.no_grad()``.
    """

    no_grad = False

    def init_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        """Called by :func:`add_hook_to_module`; returns the module (default: as given)."""
        return module

    def pre_forward(
        self, module: torch.nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Before ``forward``: the ``(args, kwargs)`` it is called with (default: unchanged)."""
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        """After ``forward``: the output returned (default: unchanged)."""
        return output

    def detach_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        """Called by :func:`remove_hook_from_module`; returns the module."""
        return module


class SequentialHook(ModelHook):
    """Several hooks as one, each event passed through them in order (what
    ``add_hook_to_module(..., append=True)`` builds)."""

    def __init__(self, *hooks: ModelHook) -> None:
        self.hooks = hooks

    def init_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        """Each hook's ``init_hook``, in order."""
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(
        self, module: torch.nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Each hook's ``pre_forward``, in order, each given the previous one's result."""
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        """Each hook's ``post_forward``, in order."""
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        """Each hook's ``detach_hook``, in order."""
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module


def _hooked_forward(module: Any, *args: Any, **kwargs: Any) -> Any:
    # Module-level (Accelerate's is a closure), so that a hooked model pickles.
    args, kwargs = module._hf_hook.pre_forward(module, *args, **kwargs)
    if module._hf_hook.no_grad:
        with torch.no_grad():
            output = module._old_forward(*args, **kwargs)
    else:
        output = module._old_forward(*args, **kwargs)
    return module._hf_hook.post_forward(module, output)


def add_hook_to_module(
    module: torch.nn.Module, hook: ModelHook, append: bool = False
) -> torch.nn.Module:
    """Attach ``hook`` to ``module`` (Accelerate's function): ``module.forward`` becomes
    ``hook.post_forward(module, old_forward(*hook.pre_forward(module, *args, **kwargs)))``,
    the original kept in ``module._old_forward``, the hook in ``module._hf_hook``.

    Args:
        module: the module, changed in place (and returned, from ``hook.init_hook``).
        hook: the hook.
        append: default ``False``: replace a hook already attached; ``True``: chain it after
            that one (a :class:`SequentialHook`).
    """
    target: Any = module  # the attributes below are set by this function: untyped
    if append and getattr(target, "_hf_hook", None) is not None:
        old_hook = target._hf_hook
        remove_hook_from_module(target)
        hook = SequentialHook(old_hook, hook)
    if hasattr(target, "_hf_hook") and hasattr(target, "_old_forward"):
        old_forward = target._old_forward  # a hook replaced: the original forward stays
    else:
        old_forward = target.forward
        target._old_forward = old_forward
    target = hook.init_hook(target)
    target._hf_hook = hook
    forward = functools.update_wrapper(functools.partial(_hooked_forward, target), old_forward)
    if "GraphModuleImpl" in str(type(target)):
        # As Accelerate: an instance forward would freeze a GraphModule's later recompiles.
        type(target).forward = forward
    else:
        target.forward = forward
    return module if target is module else cast(torch.nn.Module, target)


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
    """Detach the hook :func:`add_hook_to_module` attached (its ``detach_hook`` is called)
    and give ``module`` its original ``forward`` back (Accelerate's function).

    Args:
        module: the module, changed in place and returned.
        recurse: default ``False``; ``True``: its submodules too.
    """
    target: Any = module  # the attributes below were set by add_hook_to_module: untyped
    if hasattr(target, "_hf_hook"):
        target._hf_hook.detach_hook(target)
        delattr(target, "_hf_hook")
    if hasattr(target, "_old_forward"):
        if "GraphModuleImpl" in str(type(target)):
            type(target).forward = target._old_forward
        else:
            target.forward = target._old_forward
        delattr(target, "_old_forward")
    if recurse:
        for child in target.children():
            remove_hook_from_module(child, recurse)
    return module

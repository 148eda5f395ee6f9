"""Accelerate's ``accelerate.hooks``: forward hooks that see the keyword arguments
(:class:`ModelHook`, :class:`SequentialHook`, :func:`add_hook_to_module`,
:func:`remove_hook_from_module`) and the offloading hooks built on them
(:class:`AlignDevicesHook`, :func:`attach_align_device_hook`, :class:`CpuOffload`,
:class:`UserCpuOffloadHook`; weights kept on torch's ``meta`` device between forwards), as
Accelerate's; transformers, PEFT and diffusers attach them."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch

from kwplug.utils.structures import find_device, send_to_device

__all__ = [
    "AlignDevicesHook",
    "CpuOffload",
    "ModelHook",
    "SequentialHook",
    "UserCpuOffloadHook",
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


def _named_tensors(
    module: torch.nn.Module, include_buffers: bool = True, recurse: bool = False
) -> list[tuple[str, torch.Tensor]]:
    # Accelerate's named_module_tensors: the parameters, then the persistent buffers.
    named: list[tuple[str, torch.Tensor]] = list(module.named_parameters(recurse=recurse))
    if include_buffers:
        for name, buffer in module.named_buffers(recurse=recurse):
            owner, _, leaf = name.rpartition(".")
            holder = module.get_submodule(owner) if owner else module
            if leaf not in holder._non_persistent_buffers_set:
                named.append((name, buffer))
    return named


def _set_tensor(
    module: torch.nn.Module, name: str, device: torch.device, value: torch.Tensor | None = None
) -> None:
    # Accelerate's set_module_tensor_to_device: the tensor `name` (dotted for a submodule's)
    # replaced by `value` (else itself) on `device`; a parameter stays a Parameter.
    owner, _, leaf = name.rpartition(".")
    holder = module.get_submodule(owner) if owner else module
    old = getattr(holder, leaf)
    new = (old if value is None else value).to(device)
    if leaf in holder._parameters:
        holder._parameters[leaf] = torch.nn.Parameter(new, requires_grad=old.requires_grad)
    else:
        holder._buffers[leaf] = new


_META = torch.device("meta")


class AlignDevicesHook(ModelHook):
    """Accelerate's ``AlignDevicesHook``: the module's inputs (and, with ``offload``, its
    weights) on ``execution_device`` for its forward.

    With ``offload=True`` the parameters (and buffers with ``offload_buffers``; the others go
    to ``execution_device``) live in ``weights_map`` (name -> tensor; default: a CPU copy made
    at attach time) and on ``meta`` in the module between forwards: each forward puts them on
    ``execution_device`` (default: where they were), then back on ``meta``. ``io_same_device``:
    the output goes back to the input's device; ``skip_keys``: dict keys left where they are.
    ``remove_hook_from_module`` puts the weights back; ``tied_params_map`` is not used.
    """

    def __init__(
        self,
        execution_device: int | str | torch.device | None = None,
        offload: bool = False,
        io_same_device: bool = False,
        weights_map: Mapping[str, Any] | None = None,
        offload_buffers: bool = False,
        place_submodules: bool = False,
        skip_keys: str | list[str] | None = None,
        tied_params_map: dict[int, dict[torch.device, torch.Tensor]] | None = None,
    ) -> None:
        self.execution_device = execution_device
        self.offload, self.io_same_device = offload, io_same_device
        self.weights_map, self.offload_buffers = weights_map, offload_buffers
        self.place_submodules, self.skip_keys = place_submodules, skip_keys
        self.tied_params_map = tied_params_map
        self.input_device: torch.device | None = None
        self.original_devices: dict[str, torch.device] = {}

    def init_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        """Move the weights to ``execution_device``, or with ``offload`` to ``meta``."""
        tensors = _named_tensors(module, recurse=self.place_submodules)
        if self.execution_device is None and tensors:
            self.execution_device = tensors[0][1].device
        if not self.offload:
            if self.execution_device is not None:
                for name, _ in tensors:
                    _set_tensor(module, name, torch.device(self.execution_device))
            return module
        self.original_devices = {name: tensor.device for name, tensor in tensors}
        offloaded = _named_tensors(module, self.offload_buffers, self.place_submodules)
        if self.weights_map is None:
            self.weights_map = {name: tensor.to("cpu") for name, tensor in offloaded}
        for name, _ in offloaded:
            _set_tensor(module, name, _META)
        if not self.offload_buffers and self.execution_device is not None:
            for name, _ in module.named_buffers(recurse=self.place_submodules):
                _set_tensor(module, name, torch.device(self.execution_device))
        return module

    def _offloaded(self, module: torch.nn.Module) -> list[str]:
        return [n for n, _ in _named_tensors(module, self.offload_buffers, self.place_submodules)]

    def pre_forward(
        self, module: torch.nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Bring offloaded weights in, and the inputs, to ``execution_device``."""
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.execution_device is None:
            return args, kwargs
        device = torch.device(self.execution_device)
        if self.offload:
            assert self.weights_map is not None  # set by init_hook
            for name in self._offloaded(module):
                _set_tensor(module, name, device, self.weights_map[name])
        skip = self.skip_keys
        return send_to_device(args, device), send_to_device(kwargs, device, skip_keys=skip)

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        """Offloaded weights back to ``meta``; the output to the input's device with
        ``io_same_device``."""
        if self.offload:
            for name in self._offloaded(module):
                _set_tensor(module, name, _META)
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def detach_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        """With ``offload``, the weights back on the devices they were on."""
        if self.offload and self.weights_map is not None:
            for name, device in self.original_devices.items():
                if device != _META and name in self.weights_map:
                    _set_tensor(module, name, device, self.weights_map[name])
        return module


class CpuOffload(ModelHook):
    """Accelerate's ``CpuOffload``: the module on the CPU until its forward, which moves it to
    ``execution_device`` (default: ``PartialState().default_device``'s choice, torch's
    accelerator or the CPU) and leaves it there; ``prev_module_hook`` (a
    :class:`UserCpuOffloadHook`) is offloaded first."""

    def __init__(
        self,
        execution_device: int | str | torch.device | None = None,
        prev_module_hook: UserCpuOffloadHook | None = None,
    ) -> None:
        self.prev_module_hook = prev_module_hook
        if execution_device is None:
            accelerator = torch.accelerator.current_accelerator(check_available=True)
            execution_device = accelerator if accelerator is not None else torch.device("cpu")
        self.execution_device = torch.device(execution_device)

    def init_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module on the CPU."""
        return module.to("cpu")

    def pre_forward(
        self, module: torch.nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Offload the previous module, then the module and its inputs to
        ``execution_device``."""
        previous = self.prev_module_hook
        if previous is not None:
            first = next(previous.model.parameters(), None)
            if first is not None and first.device != torch.device("cpu"):
                previous.offload()
        first = next(module.parameters(), None)
        if first is not None and first.device == self.execution_device:
            return args, kwargs
        module.to(self.execution_device)
        device = self.execution_device
        return send_to_device(args, device), send_to_device(kwargs, device)


class UserCpuOffloadHook:
    """What :func:`kwplug.big_modeling.cpu_offload_with_hook` returns: ``offload()`` puts the
    model back on the CPU, ``remove()`` detaches the hook (Accelerate's class)."""

    def __init__(self, model: torch.nn.Module, hook: ModelHook) -> None:
        self.model, self.hook = model, hook

    def offload(self) -> None:
        """The model back on the CPU (until its next forward)."""
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        """Detach the hook (:func:`remove_hook_from_module`)."""
        remove_hook_from_module(self.model)


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
    """Attach an :class:`AlignDevicesHook` to ``module`` and every submodule holding tensors of
    its own (Accelerate's function; appended to a hook already there). ``weights_map`` is
    the whole model's, read under ``module_name``'s prefix; a module whose class is in
    ``preload_module_classes`` brings all its submodules' weights in at once (with
    ``offload``) and is not descended into."""
    full = offload and module.__class__.__name__ in (preload_module_classes or ())
    if _named_tensors(module) or full:
        prefix = f"{module_name}." if module_name else ""
        hook = AlignDevicesHook(
            execution_device=execution_device,
            offload=offload,
            weights_map=None if weights_map is None else _Prefixed(weights_map, prefix),
            offload_buffers=offload_buffers,
            place_submodules=full,
            skip_keys=skip_keys,
            tied_params_map=tied_params_map,
        )
        add_hook_to_module(module, hook, append=True)
    if full:
        return
    for child_name, child in module.named_children():
        attach_align_device_hook(
            child,
            execution_device=execution_device,
            offload=offload,
            weights_map=weights_map,
            offload_buffers=offload_buffers,
            module_name=f"{module_name}.{child_name}" if module_name else child_name,
            skip_keys=skip_keys,
            preload_module_classes=preload_module_classes,
            tied_params_map=tied_params_map,
        )


class _Prefixed(Mapping[str, Any]):
    """``weights_map`` seen from one submodule (Accelerate's ``PrefixedDataset``)."""

    def __init__(self, weights: Mapping[str, Any], prefix: str) -> None:
        self.weights, self.prefix = weights, prefix

    def __getitem__(self, key: str) -> Any:
        return self.weights[self.prefix + key]

    def __iter__(self) -> Iterator[str]:
        n = len(self.prefix)
        return (k[n:] for k in self.weights if k.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


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

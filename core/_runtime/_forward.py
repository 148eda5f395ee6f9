"""Mixed precision on every prepared model's forward, as Accelerate's ``prepare`` applies it.

With ``mixed_precision="bf16"``/``"fp16"``, ``prepare()`` replaces the model's ``forward``
(an instance attribute, before the ``wrap_model`` hook wraps it, so DDP calls it) by an
:class:`AutocastForward`: the original forward inside the Accelerator's autocast context
(the ``autocast`` hook's factory, resolved once at construction), its floating outputs
converted to float32 afterwards. ``unwrap_model(model, keep_fp32_wrapper=False)`` puts the
original back (:func:`remove_mixed_precision`).

The wrapper is a plain object holding the bound original forward and the factory, so a
prepared model pickles, and unpickles still in mixed precision (Accelerate's patched forward
pickles as the class's forward and silently runs in float32 after loading), and
``copy.deepcopy`` rebinds it to the copy.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import torch

from kwplug.hookspecs import AutocastFactory
from kwplug.utils.structures import convert_to_fp32

# Accelerate's attribute: the forward before the patch (code that knows Accelerate reads it).
ORIGINAL_FORWARD = "_original_forward"
_LOW_PRECISION = (torch.float16, torch.bfloat16)


#: The torch calls of the nested fast path, looked up once.
_is_compiling = torch.compiler.is_compiling
_function_mode = torch._C._is_torch_function_mode_enabled
_is_enabled = torch.is_autocast_enabled
_get_dtype = torch.get_autocast_dtype
_cache_on = torch.is_autocast_cache_enabled


def torch_autocast_settings(factory: Any) -> tuple[str, torch.dtype | None, bool | None] | None:
    """``(device_type, dtype, cache_enabled)`` of a ``functools.partial`` of ``torch.autocast``
    whose context enables autocast (``dtype``/``cache_enabled`` ``None``: inherited from the
    enclosing state), or ``None`` for any other factory.

    The effective state is read by entering the context once (warnings silenced: torch
    disables autocast, with a warning, for a dtype the device does not support).
    """
    if not isinstance(factory, functools.partial) or factory.func is not torch.autocast:
        return None
    try:
        bound = inspect.signature(torch.autocast).bind(*factory.args, **factory.keywords)
    except TypeError:
        return None
    device = bound.arguments.get("device_type")
    dtype = bound.arguments.get("dtype")
    cache = bound.arguments.get("cache_enabled")
    if not isinstance(device, str) or bound.arguments.get("enabled", True) is not True:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with factory():
            enabled, effective = _is_enabled(device), _get_dtype(device)
    if not enabled or (dtype is not None and effective != dtype):
        return None
    return device, dtype, cache


class AutocastForward:
    """A prepared model's ``forward``: the original forward under the autocast context, its
    float16/bfloat16 outputs converted to float32 afterwards, in nested tuples/lists/mappings
    (``ModelOutput``-like mappings rebuilt with their own type; ``Tensor.float()``,
    differentiable): Accelerate's ``convert_outputs_to_fp32(autocast(forward))``.

    Inside a region already in the context's state (``with accelerator.autocast():`` around
    the forward, the usual loop) entering ``torch.autocast`` again would change nothing but
    its nesting count, so only that is done: the count is raised and lowered (clearing the
    autocast cache when it drops to zero) and the enclosing state restored on the way out,
    as ``torch.autocast.__exit__`` does, without building the context (a few µs). Under
    ``torch.compile`` tracing or a torch function mode the context is always entered.

    ``functools.update_wrapper`` copies the original's name and docstring and sets
    ``__wrapped__`` to it, so ``inspect.signature(model.forward)`` gives the original
    signature (what ``transformers``' Trainer reads to drop unused columns).

    Args:
        forward: the model's forward before the patch (usually its bound method).
        autocast: the zero-argument factory of the autocast context (the ``autocast`` hook's
            answer; ``torch.autocast(device_type, dtype=...)``), entered once per call.
    """

    __wrapped__: Any

    def __init__(self, forward: Any, autocast: AutocastFactory) -> None:
        functools.update_wrapper(self, forward)
        self.autocast = autocast
        # The factory the settings describe: a reassigned ``autocast`` is always entered.
        self._fast = (autocast, torch_autocast_settings(autocast))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        factory, settings = self._fast
        if (
            settings is not None
            and factory is self.autocast
            and not _is_compiling()
            and not _function_mode()
            and _is_enabled(settings[0])
            and (settings[1] is None or _get_dtype(settings[0]) == settings[1])
            and (settings[2] is None or _cache_on() is settings[2])
        ):
            outputs = self._nested(settings, args, kwargs)
        else:
            with self.autocast():
                outputs = self.__wrapped__(*args, **kwargs)
        if isinstance(outputs, torch.Tensor):  # the common case, without a call
            return outputs.float() if outputs.dtype in _LOW_PRECISION else outputs
        return convert_to_fp32(outputs)

    def _nested(
        self, settings: tuple[str, torch.dtype | None, bool | None], args: Any, kwargs: Any
    ) -> Any:
        # torch.autocast's __enter__/__exit__ when its state is already the current one: the
        # state the checks found equal to the settings is not read again.
        device, dtype, cache = settings
        if dtype is None:
            dtype = _get_dtype(device)
        if cache is None:
            cache = _cache_on()
        torch.autocast_increment_nesting()
        try:
            return self.__wrapped__(*args, **kwargs)
        finally:
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()
            torch.set_autocast_enabled(device, True)
            torch.set_autocast_dtype(device, dtype)
            torch.set_autocast_cache_enabled(cache)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if "_fast" not in state:  # pickled before the fast path existed
            self._fast = (self.autocast, torch_autocast_settings(self.autocast))

    def __repr__(self) -> str:
        return f"<mixed-precision forward of {self.__wrapped__!r}>"


def apply_mixed_precision(model: torch.nn.Module, autocast: AutocastFactory) -> None:
    """Replace ``model.forward`` by an :class:`AutocastForward` (once: a model prepared
    again keeps its patch) and keep the original as ``model._original_forward``."""
    forward = model.forward
    if isinstance(forward, AutocastForward):
        return
    setattr(model, ORIGINAL_FORWARD, forward)
    model.forward = AutocastForward(forward, autocast)


def remove_mixed_precision(model: torch.nn.Module) -> None:
    """Undo :func:`apply_mixed_precision` on ``model`` (``keep_fp32_wrapper=False``): the
    class's own forward again when that is what was patched, else the patched-over one."""
    model.__dict__.pop(ORIGINAL_FORWARD, None)
    patched = model.__dict__.get("forward")
    if not isinstance(patched, AutocastForward):
        return
    original = patched.__wrapped__
    own = getattr(type(model), "forward", None)
    if getattr(original, "__self__", None) is model and getattr(original, "__func__", None) is own:
        del model.__dict__["forward"]
    else:
        model.forward = original

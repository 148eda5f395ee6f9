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
from typing import Any

import torch

from kwplug.hookspecs import AutocastFactory
from kwplug.utils.structures import convert_to_fp32

# Accelerate's attribute: the forward before the patch (code that knows Accelerate reads it).
ORIGINAL_FORWARD = "_original_forward"
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class AutocastForward:
    """A prepared model's ``forward``: the original forward under the autocast context, its
    float16/bfloat16 outputs converted to float32 afterwards, in nested tuples/lists/mappings
    (``ModelOutput``-like mappings rebuilt with their own type; ``Tensor.float()``,
    differentiable): Accelerate's ``convert_outputs_to_fp32(autocast(forward))``.

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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.autocast():
            outputs = self.__wrapped__(*args, **kwargs)
        if isinstance(outputs, torch.Tensor):  # the common case, without a call
            return outputs.float() if outputs.dtype in _LOW_PRECISION else outputs
        return convert_to_fp32(outputs)

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

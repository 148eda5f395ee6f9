"""A model without trainable parameters under DDP: placed on the device, not wrapped.

torch's ``DistributedDataParallel`` refuses such a model ("DistributedDataParallel is not
needed when a module doesn't have any parameter that requires a gradient"), and Accelerate
passes that error on. A frozen model (a distillation teacher, a reference model) has nothing
to synchronise, so the DDP handler leaves it unwrapped -- on its device, with mixed precision
applied as for any prepared model -- with a :class:`kwplug.errors.FrozenModelWarning` naming it.
"""

from __future__ import annotations

import os
import warnings

import pluggy
import torch

from kwplug.errors import FrozenModelWarning, user_stacklevel


def is_frozen(model: torch.nn.Module) -> bool:
    """Whether ``model`` has no parameter that requires a gradient (none at all included)."""
    return not any(p.requires_grad for p in model.parameters())


def warn_frozen(model: torch.nn.Module, world_size: int) -> torch.nn.Module | None:
    """Warn that ``model`` is used unwrapped; returns ``None`` (``wrap_model``'s "not wrapped").

    Warns:
        FrozenModelWarning: naming the model's class and how to prepare it without the warning.
    """
    name = type(model).__name__
    warnings.warn(
        FrozenModelWarning(
            f"prepare: model {name!r} has no trainable parameters, so it is placed on its "
            f"device without DistributedDataParallel (nothing to synchronise across the "
            f"{world_size} processes; torch's DDP refuses such a model). Each process runs "
            "its own copy. To say so explicitly: accelerator.prepare_model(model, "
            "evaluation_mode=True)",
            model=name,
        ),
        stacklevel=user_stacklevel(os.path.dirname(os.path.abspath(pluggy.__file__))),
    )
    return None

"""Per-rank state a wrapper plugin attaches to the model it wrapped, saved with checkpoints.

A wrapper can hold state on each rank that the model's ``state_dict`` does not cover: the DDP
handler's communication hook (PowerSGD's error feedback, a compression residual). The plugin
hands it over with :func:`attach_state` after wrapping; ``Accelerator.save_state`` saves it on
every rank and ``load_state`` restores it (:mod:`kwplug.checkpoint` reads it through
:func:`attached_states`, :func:`hook_state_dict` and :func:`load_hook_state`). The contract is
:class:`AttachedState`. This module sits below the plugins and the checkpoint package, so that
a plugin never imports :mod:`kwplug.checkpoint` (``tests/gates/test_layers.py``);
``kwplug.checkpoint.attach_state`` stays importable, the same function.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = [
    "AttachedState",
    "attach_state",
    "attached_states",
    "hook_state_dict",
    "load_hook_state",
    "state_label",
]

_ATTACHED: weakref.WeakKeyDictionary[torch.nn.Module, list[Any]] = weakref.WeakKeyDictionary()


class AttachedState(Protocol):
    """What :func:`attach_state` saves (``kwplug.plugins.ddp_comm_hooks.HookCheckpoint`` is one).

    A state without these methods is saved through a custom ``__getstate__`` and restored
    through ``__setstate__`` (its live ``process_group`` kept). Optional members, read when
    present: ``resize_state_dict(saved, old_world_size, new_world_size)`` (what to load of the
    saved rank 0's state on another number of processes; ``None``: start afresh),
    ``resize_note`` (``str``: what that rule does not carry over, named in a warning) and
    ``label`` (``str``: how messages name the state).
    """

    def state_dict(self) -> Any:
        """What a checkpoint saves of the state on this rank (tensors, NumPy arrays, JSON)."""
        ...

    def load_state_dict(self, saved: Any) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...


def attach_state(module: torch.nn.Module, state: AttachedState | Any) -> None:
    """Save ``state`` with ``module`` in every checkpoint, on every rank.

    For wrapper plugins whose wrapper holds per-rank state the model's ``state_dict`` does not
    cover: the DDP handler attaches the state of the communication hook it registered, with
    that hook's rules. ``state`` is saved through its ``state_dict()`` if it has one, else
    through a custom ``__getstate__``; a process group is never saved. Resuming on another
    number of processes, ``state.resize_state_dict(saved, old_world_size, new_world_size)``
    (if any) says what it loads of the saved rank 0's state, and ``state.resize_note`` what
    that loses; ``state.label``, if a ``str``, names it in messages (see
    :class:`AttachedState`). Call it once per state, in the same order on every run, after
    wrapping. The module is held weakly: attaching keeps nothing alive.

    Args:
        module: the wrapped model a plugin's ``wrap_model`` returned.
        state: the object whose state to save; ``None`` is ignored.
    """
    if state is not None:
        _ATTACHED.setdefault(module, []).append(state)


def attached_states(module: torch.nn.Module) -> list[Any]:
    """What :func:`attach_state` attached to ``module``, in order."""
    return list(_ATTACHED.get(module, ()))


def state_label(state: Any) -> str:
    """How messages name an attached state: its ``label`` (a ``str``) or its class."""
    label = getattr(state, "label", None)
    return label if isinstance(label, str) and label else type(state).__qualname__


def hook_state_dict(state: Any) -> Any:
    """A snapshot of an attached state (a DDP communication hook's), or ``None`` if stateless.

    States with ``state_dict()`` use it; others a custom ``__getstate__`` (which should leave
    out any process group). Either must hold only what checkpoints store (tensors, NumPy
    arrays and random states, JSON values). The snapshot also records the state's
    :func:`state_label`.
    """
    if state is None or isinstance(state, torch.distributed.ProcessGroup):
        return None
    label = state_label(state)
    if callable(getattr(state, "state_dict", None)):
        return {"kind": "state_dict", "value": state.state_dict(), "label": label}
    getstate: Callable[[], Any] | None = getattr(type(state), "__getstate__", None)
    if getstate is not None and getstate is not getattr(object, "__getstate__", None):
        return {"kind": "getstate", "value": state.__getstate__(), "label": label}
    return None


def load_hook_state(state: Any, saved: Any) -> None:
    """Restore a snapshot from :func:`hook_state_dict` into the live hook ``state``: through
    its ``load_state_dict`` when it has one (whatever the snapshot's kind, so that a state
    saved through ``__getstate__`` loads into one that now declares its rules), else
    ``__setstate__`` keeping the live ``process_group``."""
    if saved is None:
        return
    if saved["kind"] == "state_dict" or callable(getattr(state, "load_state_dict", None)):
        state.load_state_dict(saved["value"])
    else:
        process_group = getattr(state, "process_group", None)
        state.__setstate__(saved["value"])
        if process_group is not None:  # keep the live group, not the default one
            state.process_group = process_group

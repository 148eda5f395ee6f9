"""The DDP handler's answer to the ``sync_in_backward`` hook (a base class of
:class:`kwplug.plugins.ddp.DistributedDataParallelKwargs`, kept apart to keep that module
short)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kwplug.hookspecs import hookimpl


@contextlib.contextmanager
def _synchronising(model: torch.nn.parallel.DistributedDataParallel) -> Iterator[None]:
    # DDP decides in forward() whether the next backward reduces (prepare_for_backward runs
    # only outside no_sync); re-arm the reducer now so that the coming backward reduces the
    # gradients accumulated so far, and restore the flags no_sync() left.
    flags = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = flags


class SyncInBackward:
    """Answers ``sync_in_backward`` for ``DistributedDataParallel`` models."""

    __slots__ = ()

    @hookimpl
    def sync_in_backward(
        self, model: torch.nn.Module
    ) -> contextlib.AbstractContextManager[Any] | None:
        """A context in which the next backward of the DDP ``model`` all-reduces (through
        its communication hook) although its forward ran under ``no_sync``; ``None`` for
        another model. With ``static_graph=True`` every backward synchronises already
        (kwplug's ``no_sync`` is a no-op there): ``contextlib.nullcontext()``."""
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return None
        if getattr(model, "static_graph", False):
            return contextlib.nullcontext()
        return _synchronising(model)

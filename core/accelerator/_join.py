"""``Accelerator.join_uneven_inputs`` and ``trigger_sync_in_backward``: training on inputs
of uneven length across processes, and forcing the synchronisation of a backward pass.

Both reach the model wrapper through the plugin's own means: ``join_uneven_inputs`` through
torch's ``Joinable`` protocol (``DistributedDataParallel`` is one; so can a third-party
wrapper be), ``trigger_sync_in_backward`` through the ``sync_in_backward`` hook.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.algorithms.join import Join, Joinable
from torch.utils.data import IterableDataset

from kwplug._plugins import KwplugPluginManager
from kwplug.data import BatchSamplerShard
from kwplug.errors import KwplugWarning


def hook_target(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``no_sync``/``sync_in_backward`` are asked about: inside ``torch.compile``'s
    wrapper (``_orig_mod``, e.g. the DDP model ``prepare`` compiled last), as Accelerate's
    ``model.no_sync`` reaches it through the wrapper's attribute delegation."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def sync_in_backward(
    plugins: KwplugPluginManager, model: torch.nn.Module
) -> contextlib.AbstractContextManager[Any]:
    """The ``sync_in_backward`` hook's context for ``model``; a null context if unanswered."""
    context = plugins.first.sync_in_backward(model=hook_target(model))
    return contextlib.nullcontext() if context is None else context


def _override_even_batches(loaders: Sequence[Any], even_batches: bool) -> list[tuple[Any, bool]]:
    """Set ``even_batches`` on the shard of every prepared map-style loader; return what to
    restore. Warns (as Accelerate) when an iterable-style loader cannot follow."""
    restore: list[tuple[Any, bool]] = []
    iterable = False
    for loader in loaders:
        shard = getattr(getattr(loader, "batch_sampler", None), "batches", None)
        if isinstance(shard, BatchSamplerShard):
            restore.append((shard, shard.even_batches))
            shard.even_batches = even_batches
        elif isinstance(getattr(loader, "dataset", None), IterableDataset):
            iterable = True
    if iterable:
        # The sentence Accelerate's own test script looks for is kept in the message.
        warnings.warn(
            "join_uneven_inputs(even_batches=...): overriding even_batches is only supported "
            "for map-style datasets; some prepared data loaders are iterable-style and keep "
            "their setting",
            KwplugWarning,
            stacklevel=4,
        )
    return restore


@contextlib.contextmanager
def join_uneven_inputs(
    *,
    world_size: int,
    loaders: Sequence[Any],
    default_even_batches: bool,
    joinables: Sequence[Any],
    even_batches: bool | None,
    distributed_type: str = "MULTI_CPU",
) -> Iterator[None]:
    """See ``Accelerator.join_uneven_inputs``."""
    joinables = list(joinables)
    if world_size <= 1:  # nothing to join; Join itself wants a process group
        yield
        return
    if not str(distributed_type).startswith("MULTI_"):
        # As Accelerate: torch's Join covers data parallelism (DDP) only, not sharding.
        warnings.warn(
            "join_uneven_inputs is only supported for multi-GPU or multi-CPU data-parallel "
            f"training (DistributedDataParallel); distributed_type is {distributed_type}, so "
            "it has no effect",
            KwplugWarning,
            stacklevel=3,
        )
        yield
        return
    if not joinables or not all(isinstance(j, Joinable) for j in joinables):
        names = ", ".join(sorted({type(j).__qualname__ for j in joinables})) or "nothing"
        warnings.warn(
            "join_uneven_inputs needs models or optimizers that are torch Joinables (a model "
            f"wrapped in DistributedDataParallel), got {names}: it has no effect",
            KwplugWarning,
            stacklevel=3,
        )
        yield
        return
    restore = [] if even_batches is None else _override_even_batches(loaders, even_batches)
    even = default_even_batches if even_batches is None else even_batches
    # Join sets every joinable's join configuration on entry and never resets it: a DDP model
    # would stay in join mode after the context, its next forward a collective that a later
    # uneven loop (evaluation) never matches on the other ranks, a hang.
    # (Joinable.__init__ sets `_join_config`, the attribute Join itself writes.)
    configs = [(joinable, getattr(joinable, "_join_config", None)) for joinable in joinables]
    try:
        # Even batches need no joining: every rank gets the same number of batches.
        with Join(joinables, enable=not even, throw_on_early_termination=False):
            yield
    finally:
        for shard, value in restore:
            shard.even_batches = value
        for joinable, config in configs:
            if config is not None:
                joinable._join_config = config

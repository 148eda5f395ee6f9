"""What ``Accelerator.accumulate`` enters for a model on a micro-batch that does not
synchronise gradients, without a hook call per micro-batch where none is needed.

The ``no_sync`` hook is asked once per model (recorded in ``plan`` as any hook call). When
every implementation of it is kwplug's own code and nothing watches the manager
(:meth:`~kwplug._plugins.KwplugPluginManager.own_implementations`), the answer is remembered
per model: kwplug's built-in ``no_sync`` implementations answer from the model's class alone
(``DistributedDataParallel`` -> ``model.no_sync()``, an FSDP2 module ->
``set_requires_gradient_sync(False)``, anything else: ``None``) and read no handler field. So
the next micro-batches call the implementation that answered directly -- a fresh context,
as the hook would return -- or, when every one declined (one process, a model no plugin
wrapped), enter nothing at all, as Accelerate's ``accumulate`` does. No hook call, no
recording, no re-validation of the handlers.

Anything else asks the hook every time: tracing or monitoring switched on (so pluggy sees the
call where it happens), a third-party plugin or a user handler's own method implementing
``no_sync``, registered before or after the first micro-batch (the implementations are
compared at each call), a model whose class changed, or a remembered implementation that
declines after all.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pluggy
import torch

from kwplug._plugins import KwplugPluginManager
from kwplug.accelerator._join import hook_target

#: (the model, weakly; its class; the implementations then; the one that answered or
#: ``None``).
_Known = tuple[
    "weakref.ref[torch.nn.Module]", type, list[pluggy.HookImpl], Callable[..., Any] | None
]
_UNKNOWN: Any = object()


class SyncOff:
    """One Accelerator's ``no_sync`` contexts for :meth:`Accelerator.accumulate`.

    Args:
        plugins: the Accelerator's plugin manager.
    """

    __slots__ = ("_known", "_plugins")

    def __init__(self, plugins: KwplugPluginManager) -> None:
        self._plugins = plugins
        # id(model) -> what was learnt about it (by id: a module may define __eq__/__hash__).
        self._known: dict[int, _Known] = {}

    def context(self, model: torch.nn.Module) -> AbstractContextManager[Any] | None:
        """The context in which ``model`` skips gradient synchronisation (not entered), or
        ``None`` when there is nothing to enter (every implementation declines)."""
        target = hook_target(model)
        impls = self._plugins.own_implementations("no_sync")
        if impls is None:  # watched, or not only kwplug's own code: the hook every time
            return self._plugins.first.no_sync(model=target)
        known = self._known.get(id(target))
        if (
            known is not None
            and known[0]() is target
            and known[1] is type(target)
            and known[2] == impls
        ):
            answerer = known[3]
            if answerer is None:
                return None
            context: AbstractContextManager[Any] | None = answerer(model=target)
            if context is not None:
                return context
        context = self._plugins.first.no_sync(model=target)  # recorded in plan
        answerer = _answerer(self._plugins, impls)
        if answerer is not _UNKNOWN:
            key, known_ = id(target), self._known

            def forget(_: object) -> None:
                known_.pop(key, None)

            known_[key] = (weakref.ref(target, forget), type(target), impls, answerer)
        return context


def _answerer(plugins: KwplugPluginManager, impls: list[pluggy.HookImpl]) -> Any:
    # The implementation that answered the call just made, None when every one declined,
    # _UNKNOWN when the plan cannot tell which (one plugin with two implementations).
    answer = plugins.plan.get("no_sync")
    if answer is None:
        return _UNKNOWN
    if answer.plugin is None:
        return None
    found = [impl.function for impl in impls if impl.plugin_name == answer.plugin]
    return found[0] if len(found) == 1 else _UNKNOWN

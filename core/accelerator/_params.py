"""Keeping optimizers on the parameters a model wrapper leaves in the model.

Some wrappers replace a module's parameters instead of sharing them: FSDP2's
``torch.distributed.fsdp.fully_shard`` registers new ``DTensor`` parameters in place of the
originals. An optimizer built from ``model.parameters()`` before ``prepare`` would then step
tensors the model no longer uses. :class:`ParameterRemap` records, by parameter name, which
parameter replaced which, and points optimizers at the new ones. DDP shares the parameters, so
for it this finds nothing to do.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class ParameterRemap:
    """Old parameter -> new parameter, learnt from models before and after wrapping.

    Old parameters are held weakly (a sharded model must not keep its full-size originals
    alive); an entry whose old parameter is gone can no longer be referenced by an optimizer.
    """

    def __init__(self) -> None:
        self._new: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def __bool__(self) -> bool:
        return bool(self._new)

    def learn(
        self, before: dict[str, torch.nn.Parameter], after: dict[str, torch.nn.Parameter]
    ) -> int:
        """Record every parameter of ``before`` that ``after`` replaced under the same name.

        Args:
            before: ``dict(model.named_parameters())`` of the user's module before wrapping.
            after: the same for the (unwrapped) module after wrapping.

        Returns:
            How many parameters were replaced.
        """
        replaced = 0
        for name, old in before.items():
            new = after.get(name)
            if new is not None and new is not old:
                self._new[id(old)] = (weakref.ref(old), new)
                replaced += 1
        return replaced

    def apply(self, optimizer: torch.optim.Optimizer) -> int:
        """Point ``optimizer``'s param groups (and any per-parameter state) at the new
        parameters, in place.

        Returns:
            How many references were replaced.
        """
        replaced = 0
        for group in optimizer.param_groups:
            params = group["params"]
            for i, param in enumerate(params):
                new = self._lookup(param)
                if new is not None:
                    params[i] = new
                    replaced += 1
        state: Any = optimizer.state
        for param in list(state):
            new = self._lookup(param)
            if new is not None:
                state[new] = state.pop(param)
        return replaced

    def _lookup(self, param: torch.Tensor) -> torch.Tensor | None:
        entry = self._new.get(id(param))
        if entry is None or entry[0]() is not param:  # id reused by another tensor
            return None
        return entry[1]

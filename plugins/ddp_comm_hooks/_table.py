"""The one table of kwplug's built-in communication hooks; every list of names derives from it.

To add a built-in hook, add a :class:`BuiltinHook` row to :data:`BUILTIN_HOOKS` (and a member to
``kwplug.plugins.ddp.DDPCommunicationHookType``, which a test keeps equal to this table).
"""

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    batched_powerSGD_hook,
    powerSGD_hook,
)

from kwplug.comm_hooks import CommHook, HookFn, StateFactory
from kwplug.plugins.ddp_comm_hooks._allreduce import (
    bf16_compress_allreduce_hook,
    bf16_compress_wrapper,
    fp16_compress_allreduce_hook,
    fp16_compress_wrapper,
)
from kwplug.plugins.ddp_comm_hooks._power_sgd import (
    POWER_SGD_SCHEMA,
    batched_power_sgd_hook,
    make_power_sgd_state,
)
from kwplug.validators import OptionSchema

#: Source recorded in the :class:`~kwplug.CommHook` records of the built-in hooks.
SOURCE = "kwplug"


@attrs.frozen
class BuiltinHook:
    """One built-in communication hook.

    Attributes:
        name: what users pass as ``DistributedDataParallelKwargs(comm_hook=name)``.
        hook: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``.
        wrapper: the ``comm_wrapper=name`` factory (``wrapper(hook) -> hook``) running any hook
            in this hook's precision, or ``None`` when ``name`` is not a ``comm_wrapper`` value.
        layout_dependent: the hook's state depends on DDP's bucket layout, so kwplug runs it
            through :func:`~kwplug.plugins.ddp_comm_hooks.canonical_bucket_hook` (and, on gloo,
            :func:`~kwplug.plugins.ddp_comm_hooks.serialized_hook`).
        options: the schema of ``comm_state_option``; ``None`` means the hook takes no options
            and its state is the process group.
        make_state: ``make_state(process_group, comm_state_option) -> state`` (with ``options``).
    """

    name: str
    hook: HookFn
    wrapper: Callable[[HookFn], HookFn] | None = None
    layout_dependent: bool = False
    options: OptionSchema | None = None
    make_state: StateFactory | None = None

    def record(self) -> CommHook:
        """The :class:`~kwplug.CommHook` contributed through the ``comm_hooks`` hook."""
        check = self.options.check if self.options is not None else None
        return CommHook(self.name, self.hook, self.make_state, SOURCE, check)


#: kwplug's built-in hooks, in the order they are listed to users.
BUILTIN_HOOKS: tuple[BuiltinHook, ...] = (
    BuiltinHook("fp16", fp16_compress_allreduce_hook, wrapper=fp16_compress_wrapper),
    BuiltinHook("bf16", bf16_compress_allreduce_hook, wrapper=bf16_compress_wrapper),
    BuiltinHook(
        "power_sgd",
        powerSGD_hook,
        layout_dependent=True,
        options=POWER_SGD_SCHEMA,
        make_state=make_power_sgd_state,
    ),
    BuiltinHook(
        "batched_power_sgd",
        batched_power_sgd_hook,
        layout_dependent=True,
        options=POWER_SGD_SCHEMA,
        make_state=make_power_sgd_state,
    ),
)

#: The rows of :data:`BUILTIN_HOOKS` by name.
BUILTIN_BY_NAME: Mapping[str, BuiltinHook] = MappingProxyType({h.name: h for h in BUILTIN_HOOKS})

#: Names of the built-in hooks, in table order.
BUILTIN_HOOK_NAMES: tuple[str, ...] = tuple(BUILTIN_BY_NAME)

#: ``comm_wrapper`` value -> wrapper factory (the rows with a ``wrapper``).
COMPRESSION_WRAPPERS: Mapping[str, Callable[[HookFn], HookFn]] = MappingProxyType(
    {h.name: h.wrapper for h in BUILTIN_HOOKS if h.wrapper is not None}
)

#: Hook functions whose state depends on DDP's bucket layout: the layout-dependent rows, plus
#: torch's ``batched_powerSGD_hook`` when a user passes it as a callable ``comm_hook``.
LAYOUT_DEPENDENT_HOOKS: frozenset[Callable[..., Any]] = frozenset(
    {h.hook for h in BUILTIN_HOOKS if h.layout_dependent} | {batched_powerSGD_hook}
)


def builtin_comm_hooks() -> dict[str, CommHook]:
    """kwplug's named hooks as :class:`~kwplug.CommHook` records, by name (a new dict each call).

    One per row of :data:`BUILTIN_HOOKS`: ``"fp16"`` and ``"bf16"`` (state: the process
    group), ``"power_sgd"`` (torch's per-tensor ``powerSGD_hook``) and ``"batched_power_sgd"``
    (state from :func:`~kwplug.plugins.ddp_comm_hooks.make_power_sgd_state`).
    """
    return dict(_builtin_records())


@functools.cache
def _builtin_records() -> tuple[tuple[str, CommHook], ...]:
    # Built once per process: BUILTIN_HOOKS is a tuple of frozen rows and a CommHook is frozen
    # (its training state comes from make_state, per DDP model), so every Accelerator can
    # share the records; each caller still gets its own dict.
    return tuple((h.name, h.record()) for h in BUILTIN_HOOKS)

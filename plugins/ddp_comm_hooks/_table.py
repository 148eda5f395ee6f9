"""The one table of kwplug's built-in communication hooks; every list of names derives from it.

To add a built-in hook, add a :class:`BuiltinHook` row to :data:`BUILTIN_HOOKS` (and a member to
``kwplug.plugins.ddp.DDPCommunicationHookType``, which a test keeps equal to this table). A row
carries the hook's state rules (bucketing, saving, restoring, resizing) as a third-party
:class:`~kwplug.CommHook` does; :func:`callable_record` gives a hook passed as a callable the
rules of the row it is (or of torch's function it stands for).
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
from kwplug.plugins.ddp_comm_hooks._common import describe
from kwplug.plugins.ddp_comm_hooks._power_sgd import (
    POWER_SGD_SCHEMA,
    batched_power_sgd_hook,
    make_power_sgd_state,
    power_sgd_state_buckets,
)
from kwplug.plugins.ddp_comm_hooks._power_sgd_inplace import power_sgd_inplace_hook
from kwplug.plugins.ddp_comm_hooks._power_sgd_state import (
    POWER_SGD_RESIZE_NOTE,
    load_power_sgd_state,
    power_sgd_state_dict,
    resize_power_sgd_state,
)
from kwplug.validators import OptionSchema

#: Source recorded in the :class:`~kwplug.CommHook` records of the built-in hooks.
SOURCE = "kwplug"


def _read_only(rules: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(rules))


@attrs.frozen
class BuiltinHook:
    """One built-in communication hook.

    Attributes:
        name: what users pass as ``DistributedDataParallelKwargs(comm_hook=name)``.
        hook: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``.
        wrapper: the ``comm_wrapper=name`` factory (``wrapper(hook) -> hook``) running any hook
            in this hook's precision, or ``None`` when ``name`` is not a ``comm_wrapper`` value.
        options: the schema of ``comm_state_option``; ``None`` means the hook takes no options
            and its state is the process group.
        make_state: ``make_state(process_group, comm_state_option) -> state`` (with ``options``).
        rules: the record's state rules, the keyword fields of :class:`~kwplug.CommHook`
            (``state_buckets``, ``chains_collectives``, ``state_dict``, ``load_state_dict``,
            ``resize``, ``resize_note``), by name.
    """

    name: str
    hook: HookFn
    wrapper: Callable[[HookFn], HookFn] | None = None
    options: OptionSchema | None = None
    make_state: StateFactory | None = None
    rules: Mapping[str, Any] = attrs.field(factory=dict, converter=_read_only)

    @property
    def layout_dependent(self) -> bool:
        """The state depends on DDP's bucket layout (the row has ``state_buckets``)."""
        return self.rules.get("state_buckets") is not None

    def record(self) -> CommHook:
        """The :class:`~kwplug.CommHook` contributed through the ``comm_hooks`` hook."""
        check = self.options.check if self.options is not None else None
        return CommHook(self.name, self.hook, self.make_state, SOURCE, check, **self.rules)


#: The state rules of the PowerSGD hooks: layout-dependent (error feedback and P/Q keyed by
#: bucket), a second all-reduce chained on the first, saved as ``__getstate__``, counters kept
#: across sizes.
POWER_SGD_RULES: Mapping[str, Any] = MappingProxyType(
    {
        "state_buckets": power_sgd_state_buckets,
        "chains_collectives": True,
        "state_dict": power_sgd_state_dict,
        "load_state_dict": load_power_sgd_state,
        "resize": resize_power_sgd_state,
        "resize_note": POWER_SGD_RESIZE_NOTE,
    }
)


#: kwplug's built-in hooks, in the order they are listed to users.
BUILTIN_HOOKS: tuple[BuiltinHook, ...] = (
    BuiltinHook("fp16", fp16_compress_allreduce_hook, wrapper=fp16_compress_wrapper),
    BuiltinHook("bf16", bf16_compress_allreduce_hook, wrapper=bf16_compress_wrapper),
    BuiltinHook(
        "power_sgd",
        powerSGD_hook,
        options=POWER_SGD_SCHEMA,
        make_state=make_power_sgd_state,
        rules=POWER_SGD_RULES,
    ),
    BuiltinHook(
        "batched_power_sgd",
        batched_power_sgd_hook,
        options=POWER_SGD_SCHEMA,
        make_state=make_power_sgd_state,
        rules=POWER_SGD_RULES,
    ),
    BuiltinHook(
        "power_sgd_inplace",
        power_sgd_inplace_hook,
        options=POWER_SGD_SCHEMA,
        make_state=make_power_sgd_state,
        rules=POWER_SGD_RULES,
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


#: Source recorded in the :class:`~kwplug.CommHook` of a hook passed as a callable.
CALLABLE_SOURCE = "DistributedDataParallelKwargs.comm_hook"


def callable_record(hook: HookFn) -> CommHook:
    """The :class:`~kwplug.CommHook` of a hook passed as ``comm_hook=callable``.

    A layout-dependent built-in hook function (one of :data:`LAYOUT_DEPENDENT_HOOKS`, torch's
    PowerSGD functions included) gets the PowerSGD rules; any other callable none (its state
    is ``None``, nothing to save).

    Args:
        hook: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``.

    Returns:
        A record named after the hook, with source :data:`CALLABLE_SOURCE`.
    """
    try:
        layout_dependent = hook in LAYOUT_DEPENDENT_HOOKS
    except TypeError:  # an unhashable callable object
        layout_dependent = False
    rules = POWER_SGD_RULES if layout_dependent else {}
    return CommHook(describe(hook), hook, source=CALLABLE_SOURCE, **rules)


def builtin_comm_hooks() -> dict[str, CommHook]:
    """kwplug's named hooks as :class:`~kwplug.CommHook` records, by name (a new dict each call).

    One per row of :data:`BUILTIN_HOOKS`: ``"fp16"`` and ``"bf16"`` (state: the process
    group), ``"power_sgd"`` (torch's per-tensor ``powerSGD_hook``), ``"batched_power_sgd"``
    and ``"power_sgd_inplace"`` (kwplug's own; state from
    :func:`~kwplug.plugins.ddp_comm_hooks.make_power_sgd_state`).
    """
    return dict(_builtin_records())


@functools.cache
def _builtin_records() -> tuple[tuple[str, CommHook], ...]:
    # Built once per process: BUILTIN_HOOKS is a tuple of frozen rows and a CommHook is frozen
    # (its training state comes from make_state, per DDP model), so every Accelerator can
    # share the records; each caller still gets its own dict.
    return tuple((h.name, h.record()) for h in BUILTIN_HOOKS)

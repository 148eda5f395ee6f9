"""kwplug's built-in DDP communication hooks, contributed through the ``comm_hooks`` hook.

This package is itself a plugin object (entry point ``ddp_comm_hooks`` of the
``kwplug.handlers`` group): its module-level :func:`comm_hooks` implementation gives the named
hooks of :data:`BUILTIN_HOOKS` (``"fp16"``, ``"bf16"``, ``"power_sgd"``,
``"batched_power_sgd"``, ``"power_sgd_inplace"``; source ``"kwplug"``) once per Accelerator,
whatever handlers are registered. :data:`BUILTIN_HOOKS` is the one table of built-in hooks:
the names, the ``comm_wrapper`` factories and the layout-dependent hooks are all derived from
it.

Everything a hook's state needs beyond the hook function lives here too, declared on its
:class:`~kwplug.CommHook` record (built-in and third-party alike): :func:`compose` builds the
callable DDP registers (hook, compression wrapper, gloo ordering, canonical buckets) and
:func:`checkpointed_state` what checkpoints save, restore and resize (:class:`HookCheckpoint`).

Every hook follows PyTorch's contract for
``torch.nn.parallel.DistributedDataParallel.register_comm_hook``:
``hook(state, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]``,
where the future's tensor is the *averaged* gradient bucket (same shape as
``bucket.buffer()``).

Modules (private; import the names from here): ``_table`` (the table), ``_allreduce`` (plain
and low-precision all-reduce, compression wrappers), ``_power_sgd`` (PowerSGD state, options
and the batched hook), ``_power_sgd_inplace`` (kwplug's per-tensor PowerSGD),
``_power_sgd_state`` (PowerSGD's save, restore and resize rules),
``_compose`` (the registered callable), ``_checkpoint`` (a hook's state as checkpoints see it),
``_canonical`` (the layout-independent bucket view that makes a resumed PowerSGD run exact),
``_bucket_plan`` (how a real bucket is cut into canonical ones; the recorded bucket layout),
``_adapters`` (gloo ordering of chained collectives, making any callable acceptable to DDP),
``_common`` (shared helpers).
"""

from collections.abc import Mapping

from kwplug.comm_hooks import CommHook
from kwplug.hookspecs import hookimpl
from kwplug.plugins.ddp_comm_hooks._adapters import (
    ddp_compatible_hook,
    ordered_hook,
    serialized_hook,
)
from kwplug.plugins.ddp_comm_hooks._allreduce import (
    bf16_compress_allreduce_hook,
    bf16_compress_wrapper,
    fp16_compress_allreduce_hook,
    fp16_compress_wrapper,
    mean_allreduce_hook,
)
from kwplug.plugins.ddp_comm_hooks._bucket_plan import BucketKey
from kwplug.plugins.ddp_comm_hooks._canonical import CanonicalBucket, canonical_bucket_hook
from kwplug.plugins.ddp_comm_hooks._checkpoint import HookCheckpoint, checkpointed_state
from kwplug.plugins.ddp_comm_hooks._compose import compose
from kwplug.plugins.ddp_comm_hooks._power_sgd import (
    POWER_SGD_OPTIONS,
    POWER_SGD_SCHEMA,
    batched_power_sgd_hook,
    check_power_sgd_options,
    make_power_sgd_state,
    power_sgd_state_buckets,
)
from kwplug.plugins.ddp_comm_hooks._power_sgd_inplace import power_sgd_inplace_hook
from kwplug.plugins.ddp_comm_hooks._power_sgd_state import (
    POWER_SGD_KEPT,
    POWER_SGD_RESIZE_NOTE,
    load_power_sgd_state,
    power_sgd_state_dict,
    resize_power_sgd_state,
)
from kwplug.plugins.ddp_comm_hooks._table import (
    BUILTIN_BY_NAME,
    BUILTIN_HOOK_NAMES,
    BUILTIN_HOOKS,
    CALLABLE_SOURCE,
    COMPRESSION_WRAPPERS,
    LAYOUT_DEPENDENT_HOOKS,
    POWER_SGD_RULES,
    SOURCE,
    BuiltinHook,
    builtin_comm_hooks,
    callable_record,
)

__all__ = [
    "BUILTIN_BY_NAME",
    "BUILTIN_HOOKS",
    "BUILTIN_HOOK_NAMES",
    "CALLABLE_SOURCE",
    "COMPRESSION_WRAPPERS",
    "LAYOUT_DEPENDENT_HOOKS",
    "POWER_SGD_KEPT",
    "POWER_SGD_OPTIONS",
    "POWER_SGD_RESIZE_NOTE",
    "POWER_SGD_RULES",
    "POWER_SGD_SCHEMA",
    "SOURCE",
    "BucketKey",
    "BuiltinHook",
    "CanonicalBucket",
    "HookCheckpoint",
    "batched_power_sgd_hook",
    "bf16_compress_allreduce_hook",
    "bf16_compress_wrapper",
    "builtin_comm_hooks",
    "callable_record",
    "canonical_bucket_hook",
    "check_power_sgd_options",
    "checkpointed_state",
    "comm_hooks",
    "compose",
    "ddp_compatible_hook",
    "fp16_compress_allreduce_hook",
    "fp16_compress_wrapper",
    "load_power_sgd_state",
    "make_power_sgd_state",
    "mean_allreduce_hook",
    "ordered_hook",
    "power_sgd_inplace_hook",
    "power_sgd_state_buckets",
    "power_sgd_state_dict",
    "resize_power_sgd_state",
    "serialized_hook",
]


@hookimpl
def comm_hooks() -> Mapping[str, CommHook]:
    """Answer the ``comm_hooks`` hook with :func:`builtin_comm_hooks`.

    A module-level implementation, so that the hooks are contributed exactly once per
    Accelerator (the ``DistributedDataParallelKwargs`` handler may be registered both as the
    default instance and as the user's).
    """
    return builtin_comm_hooks()

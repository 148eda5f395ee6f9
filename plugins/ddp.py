"""``DistributedDataParallelKwargs``: the DDP wrapper, its communication hook, ``no_sync``."""

from __future__ import annotations

import contextlib
import enum
import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from kwplug.attached_state import attach_state
from kwplug.comm_hooks import CommHook, HookFn, check_hook_signature
from kwplug.errors import KwplugWarning
from kwplug.handler import TO_KWARGS, KwargsHandler
from kwplug.hookspecs import hookimpl
from kwplug.plugins import _ddp_comm, ddp_comm_hooks
from kwplug.plugins._ddp_frozen import is_frozen, warn_frozen
from kwplug.plugins._ddp_sync import SyncInBackward
from kwplug.validators import number, strict_bool


class DDPCommunicationHookType(str, enum.Enum):
    """Names of kwplug's built-in DDP communication hooks (and compression wrappers).

    Members: ``NO = "no"`` (DDP's own all-reduce, no hook), ``FP16 = "fp16"`` and
    ``BF16 = "bf16"`` (all-reduce in half precision), ``POWER_SGD = "power_sgd"`` (torch's
    per-tensor PowerSGD), ``BATCHED_POWER_SGD = "batched_power_sgd"`` (PowerSGD over the
    whole bucket) and ``POWER_SGD_INPLACE = "power_sgd_inplace"`` (kwplug's per-tensor
    PowerSGD: two collectives per bucket, in-place error feedback). Being a ``str`` enum, each
    member compares equal to its value.
    """

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"
    POWER_SGD_INPLACE = "power_sgd_inplace"

    def __str__(self) -> str:
        return self.value


_HOOK_VALUES = tuple(member.value for member in DDPCommunicationHookType)
# "no" plus the table's rows that have a compression wrapper.
_WRAPPER_VALUES = (DDPCommunicationHookType.NO.value, *ddp_comm_hooks.COMPRESSION_WRAPPERS)
_HOOKS_LISTED, _WRAPPERS_LISTED = _ddp_comm.quoted(_HOOK_VALUES), _ddp_comm.quoted(_WRAPPER_VALUES)


def _to_hook_type(value: Any) -> Any:
    # The enum's values become members; other strings are custom hook names, kept as given.
    # Accelerate's scripts pass None (its register_comm_hook looks the field up with
    # dict.get: None means no hook/wrapper) and members of accelerate's own
    # DDPCommunicationHookType (a plain Enum, not a str): both mean the same hook here.
    if value is None:
        return DDPCommunicationHookType.NO
    if isinstance(value, enum.Enum) and not isinstance(value, DDPCommunicationHookType):
        try:
            return DDPCommunicationHookType(value.value)
        except ValueError:
            return value  # refused by the validator, naming the foreign member
    if isinstance(value, str) and not isinstance(value, DDPCommunicationHookType):
        try:
            return DDPCommunicationHookType(value)
        except ValueError:
            return value
    return value


def _check_comm_hook(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, DDPCommunicationHookType):
        return
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(
                f"'{attribute.name}' must not be empty: give one of {_HOOKS_LISTED} or "
                "the name of a registered communication hook"
            )
        return
    if callable(value) and not isinstance(value, type):
        check_hook_signature(attribute.name, value)
        return
    raise TypeError(
        f"'{attribute.name}' must be a DDPCommunicationHookType, one of {_HOOKS_LISTED}, "
        "the name (str) of a hook registered with kwplug.register_comm_hook or contributed by "
        "a plugin, or a callable hook(state, bucket) -> torch.futures.Future[torch.Tensor]; "
        f"got {value!r} of type {type(value).__name__}"
    )


def _check_comm_wrapper(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, str) and value in _WRAPPER_VALUES:
        return  # every construction and hook call re-validates: no message to build
    members = "/".join(value.upper() for value in _WRAPPER_VALUES)
    wanted = f"DDPCommunicationHookType.{members} or one of {_WRAPPERS_LISTED}"
    if not isinstance(value, str):
        raise TypeError(
            f"'{attribute.name}' must be {wanted}, got {value!r} of type {type(value).__name__}"
        )
    if value not in _WRAPPER_VALUES:
        raise ValueError(f"'{attribute.name}' must be {wanted}, got {str(value)!r}")


def _check_str_keys(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    bad = [key for key in value if not isinstance(key, str)]
    if bad:
        raise TypeError(f"'{attribute.name}' keys must be str, got {bad!r}")


def _no_options(value: Any) -> Any:
    # Accelerate passes comm_state_option through as given; None (no options) works there
    # with every hook but PowerSGD's, which fails on **None. Here None is no options.
    return {} if value is None else value


# attrs names the field and says "must be <class 'dict'>"; the keys get their own message.
_check_state_option = attrs.validators.and_(attrs.validators.instance_of(dict), _check_str_keys)


#: Largest accepted ``bucket_cap_mb`` (MiB): about 1 TB, beyond any device's memory; larger values
#: only overflow the byte count torch computes from it.
MAX_BUCKET_CAP_MB = 1_000_000


@attrs.define
class DistributedDataParallelKwargs(SyncInBackward, KwargsHandler):
    """Options of ``torch.nn.parallel.DistributedDataParallel`` and of its communication hook.

    When the Accelerator runs in more than one process, ``prepare(model)`` returns
    ``DistributedDataParallel(model, device_ids=[device.index] (None on CPU), **to_kwargs())``
    with the hook below registered through ``DistributedDataParallel.register_comm_hook``. In
    a single process the model is returned unwrapped. Only the constructor options that differ
    from the defaults reach torch (``to_kwargs()``; the ``comm_*`` fields are never passed).

    Attributes:
        dim: ``int``, default ``0``; ``DistributedDataParallel(dim=...)``, the dimension along
            which inputs are scattered (single-device modules ignore it).
        broadcast_buffers: ``bool``, default ``True``; sync module buffers from rank 0 at
            construction and before each forward. ``False`` is passed on as
            ``broadcast_buffers=False``, which torch 2.13 still honours but deprecates with a
            ``FutureWarning`` (in favour of ``forward_sync_buffers``).
        bucket_cap_mb: ``int`` or ``float`` > 0, in megabytes (MiB), default ``25``; the size
            of the gradient buckets all-reduced together (``bucket_cap_mb``). The default is
            not passed, so torch also keeps its smaller first bucket.
        find_unused_parameters: ``bool``, default ``False``; traverse the autograd graph each
            step to mark parameters that got no gradient (needed when the forward skips some).
        check_reduction: ``bool``, default ``False``; deprecated by torch (ignored there, with
            a ``FutureWarning`` when ``True``).
        gradient_as_bucket_view: ``bool``, default ``False``; make ``param.grad`` views into
            the communication buckets (saves a copy and memory).
        static_graph: ``bool``, default ``False``; promise that the set of used parameters and
            the graph do not change between steps (``_set_static_graph``).
        comm_hook: default ``DDPCommunicationHookType.NO`` (DDP's own all-reduce). One of:
            a ``DDPCommunicationHookType`` or its value (``"fp16"``, ``"bf16"``,
            ``"power_sgd"``, ``"batched_power_sgd"``; the string is converted to the member;
            ``None`` and a member of Accelerate's ``DDPCommunicationHookType`` are converted
            too, ``None`` to ``NO``, as Accelerate treats them);
            any other non-empty ``str``, the name of a hook registered with
            :func:`kwplug.register_comm_hook` or contributed by a plugin's ``comm_hooks`` hook,
            looked up when the model is wrapped; or a callable ``hook(state, bucket) ->
            torch.futures.Future[torch.Tensor]``, registered with ``state=None`` (the default
            process group). The registered callable is built by
            :func:`kwplug.plugins.ddp_comm_hooks.compose` from the hook's
            :class:`~kwplug.CommHook` record: a layout-dependent hook (one with
            ``state_buckets``, such as the PowerSGD hooks) runs, with its wrapper, behind
            :func:`kwplug.plugins.ddp_comm_hooks.canonical_bucket_hook` so that its state does
            not depend on DDP's bucket layout (exact resume from a checkpoint); this costs one
            gather and one scatter copy of each bucket per step once DDP has rebuilt its
            buckets.
        comm_wrapper: ``DDPCommunicationHookType.NO`` (default), ``FP16`` or ``BF16`` (or
            ``"no"``/``"fp16"``/``"bf16"``; ``None`` is ``NO``, a member of Accelerate's enum
            kwplug's member of its value): run the hook on a float16/bfloat16 copy of each
            bucket (:func:`kwplug.plugins.ddp_comm_hooks.fp16_compress_wrapper`). With
            ``comm_hook="no"`` the wrapper wraps a plain mean all-reduce.
        comm_state_option: ``dict`` with ``str`` keys (``None`` is ``{}``), default ``{}``;
            options of the hook's
            state, given to ``CommHook.make_state(process_group, options)``. For
            ``"power_sgd"``/``"batched_power_sgd"`` they are keyword arguments of
            ``PowerSGDState`` (e.g. ``{"matrix_approximation_rank": 2,
            "start_powerSGD_iter": 100}``). Must be empty for hooks without state options
            (``"no"``, ``"fp16"``, ``"bf16"``, a callable).

    Raises:
        TypeError: a field has the wrong type (``bool`` is not an ``int`` here, and ``0``/``1``
            are not bools); the message names the field and what it accepts. A callable
            ``comm_hook`` that cannot be called as ``hook(state, bucket)`` (its signature is
            read with :func:`inspect.signature`) is a ``TypeError`` here, not at the first
            ``backward``.
        ValueError: ``bucket_cap_mb`` <= 0 or above :data:`MAX_BUCKET_CAP_MB`; an empty
            ``comm_hook`` name; a ``comm_wrapper``
            other than no/fp16/bf16; at construction, ``comm_state_option`` keys that the
            chosen built-in hook does not accept (PowerSGD: the message lists the accepted
            keys), or options with ``"no"``/``"fp16"``/``"bf16"``/a callable hook.
            Per-field checks also run on assignment; the cross-field checks run again when the
            model is wrapped, where an unknown hook name also raises ``ValueError`` listing the
            known names.
    """

    dim: int = attrs.field(default=0, validator=number(integer=True))
    broadcast_buffers: bool = attrs.field(default=True, validator=strict_bool)
    bucket_cap_mb: float = attrs.field(default=25, validator=number(gt=0, le=MAX_BUCKET_CAP_MB))
    find_unused_parameters: bool = attrs.field(default=False, validator=strict_bool)
    check_reduction: bool = attrs.field(default=False, validator=strict_bool)
    gradient_as_bucket_view: bool = attrs.field(default=False, validator=strict_bool)
    static_graph: bool = attrs.field(default=False, validator=strict_bool)
    comm_hook: DDPCommunicationHookType | str | HookFn = attrs.field(
        default=DDPCommunicationHookType.NO,
        converter=_to_hook_type,
        validator=_check_comm_hook,
        metadata={TO_KWARGS: False},
    )
    comm_wrapper: DDPCommunicationHookType = attrs.field(
        default=DDPCommunicationHookType.NO,
        converter=_to_hook_type,
        validator=_check_comm_wrapper,
        metadata={TO_KWARGS: False},
    )
    comm_state_option: dict[str, Any] = attrs.field(
        default=attrs.Factory(dict),
        converter=_no_options,
        validator=_check_state_option,
        metadata={TO_KWARGS: False},
    )

    def __attrs_post_init__(self) -> None:
        self._check_state_for_hook()

    def _check_state_for_hook(self) -> None:
        # Cross-field check, at construction and when wrapping (not on assignment, so that
        # comm_hook and comm_state_option can be changed one after the other in any order).
        _ddp_comm.check_state_for_hook(
            self.comm_hook, self.comm_state_option, named_builtin=self._named_builtin
        )

    @property
    def _named_builtin(self) -> bool:
        return isinstance(self.comm_hook, DDPCommunicationHookType)

    def _record(self, comm_hooks: Mapping[str, CommHook]) -> CommHook:
        """The named hook ``comm_hook`` selects.

        Raises:
            ValueError: no hook has that name (the message lists the known names).
        """
        return _ddp_comm.find_record(
            str(self.comm_hook), comm_hooks, named_builtin=self._named_builtin
        )

    def _hook_and_state(
        self, comm_hooks: Mapping[str, CommHook], parameters: Iterable[torch.Tensor] = ()
    ) -> tuple[HookFn | None, Any, CommHook | None]:
        """The hook to register, its state and its record; ``(None, None, None)`` for DDP's
        own all-reduce.

        The callable comes from :func:`~kwplug.plugins.ddp_comm_hooks.compose` (the record's
        hook, gloo ordering, the ``comm_wrapper``, canonical buckets for a
        layout-dependent hook with ``parameters`` - the model's, in order - as the canonical
        order)."""
        self._check_state_for_hook()
        return _ddp_comm.hook_and_state(
            self.comm_hook,
            str(self.comm_wrapper),
            self.comm_state_option,
            comm_hooks,
            parameters,
            named_builtin=self._named_builtin,
        )

    @hookimpl
    def validate_setup(self, comm_hooks: Mapping[str, CommHook]) -> None:
        """Check ``comm_hook`` and ``comm_state_option`` when the Accelerator is built.

        The names plugins contribute are known only then, so this is the earliest check: a
        misspelt name or an option the named hook refuses fails in ``Accelerator()``, before
        the process group, the data and the model exist.

        Raises:
            ValueError: unknown ``comm_hook`` name (with a suggestion and the known names).
            TypeError, ValueError: from the named hook's ``check_options``.
        """
        if isinstance(self.comm_hook, str) and self.comm_hook != DDPCommunicationHookType.NO:
            self._record(comm_hooks).check(self.comm_state_option)

    @hookimpl
    def wrap_model(
        self,
        model: torch.nn.Module,
        device: torch.device,
        world_size: int,
        comm_hooks: Mapping[str, CommHook],
    ) -> torch.nn.Module | None:
        """Wrap ``model`` in ``torch.nn.parallel.DistributedDataParallel`` when distributed.

        Args:
            model: the module, already on ``device``.
            device: ``torch.device``; ``device_ids=[device.index]`` for an indexed
                accelerator device, ``None`` on CPU.
            world_size: number of processes; ``<= 1`` returns ``None`` (model used unwrapped),
                as does a model without trainable parameters (``FrozenModelWarning``).
            comm_hooks: the named hooks known to the Accelerator (``comm_hook`` names are
                looked up here).

        Returns:
            The DDP module with the communication hook registered
            (``DistributedDataParallel.register_comm_hook(state, hook)``, the hook from
            :func:`~kwplug.plugins.ddp_comm_hooks.compose` with ``model.parameters()`` as the
            canonical order), or ``None``. The hook's state, with its record's checkpoint
            rules (:func:`~kwplug.plugins.ddp_comm_hooks.checkpointed_state`), is handed to
            checkpoints with :func:`kwplug.attached_state.attach_state`.

        Raises:
            ValueError: unknown ``comm_hook`` name (lists the known names); ``comm_state_option``
                not accepted by the hook (checked before DDP is built, so no collective runs).
            TypeError: from torch when DDP rejects the hook (e.g. a wrong ``bucket``
                annotation).
        """
        if world_size <= 1 or is_frozen(model):  # frozen: torch's DDP refuses it; not wrapped
            # The handler may have changed since Accelerator() checked it.
            self.validate_setup(comm_hooks)
            return warn_frozen(model, world_size) if world_size > 1 else None
        hook, state, record = self._hook_and_state(comm_hooks, list(model.parameters()))
        device_ids = [device.index] if device.type != "cpu" and device.index is not None else None
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=device_ids, **self.to_kwargs()
        )
        if hook is not None and record is not None:
            ddp.register_comm_hook(state, hook)
            # Checkpoints save, restore and resize the state by the record's rules.
            attach_state(ddp, ddp_comm_hooks.checkpointed_state(record, state))
        return ddp

    @hookimpl
    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any] | None:
        """``model.no_sync()`` for a ``DistributedDataParallel`` ``model``, else ``None``.

        Under it DDP neither reduces gradients nor calls the communication hook (PowerSGD's
        step counter and error feedback advance only on the synchronising backward). With
        ``static_graph=True`` torch's ``no_sync`` crashes or stops reducing
        (pytorch/pytorch#143580): the model then synchronises every micro-batch
        (``contextlib.nullcontext()``, the same sum for an exact all-reduce) and a
        ``KwplugWarning`` says so once.
        """
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return None
        if getattr(model, "static_graph", False):
            if model not in _WARNED_STATIC:
                _WARNED_STATIC.add(model)
                warnings.warn(
                    "DistributedDataParallelKwargs(static_graph=True): gradients are synchronised"
                    " on every accumulation micro-batch, because torch's no_sync() is broken "
                    "with a static graph (pytorch/pytorch#143580); static_graph=False skips them",
                    KwplugWarning,
                    stacklevel=2,
                )
            return contextlib.nullcontext()
        return model.no_sync()


_WARNED_STATIC: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

"""Named DDP communication hooks: the record type and the process-wide registry.

A communication hook is PyTorch's ``hook(state, bucket: torch.distributed.GradBucket) ->
torch.futures.Future[torch.Tensor]`` (see ``DistributedDataParallel.register_comm_hook``). kwplug
names hooks so that ``DistributedDataParallelKwargs(comm_hook="name")`` can select them; names
come from :func:`register_comm_hook` and from plugins' ``comm_hooks`` hook.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from kwplug._additive import merge

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import GradBucket

    HookFn = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]
    StateFactory = Callable[[dist.ProcessGroup | None, Mapping[str, Any]], Any]
else:
    HookFn = Callable[..., Any]
    StateFactory = Callable[..., Any]


@attrs.frozen
class CommHook:
    """A named DDP communication hook.

    Attributes:
        name: the name users pass as ``comm_hook=...``.
        hook: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``, registered with
            ``DistributedDataParallel.register_comm_hook(state, hook)``.
        make_state: ``make_state(process_group, comm_state_option) -> state``, called after the
            process group exists; ``None`` means the state is the process group itself (the
            convention of ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``).
        source: who provided it (a distribution or ``"kwplug.register_comm_hook"``), for errors.
        check_options: optional ``check_options(comm_state_option)`` that raises
            ``TypeError``/``ValueError`` for options ``make_state`` would refuse, without a
            process group (its return value is ignored). kwplug calls it when the Accelerator
            is built (``validate_setup``) and, in a single process where DDP is not used and
            ``make_state`` never runs, in ``prepare()``: a bad option fails early everywhere.
    """

    name: str = attrs.field(validator=attrs.validators.instance_of(str))
    hook: HookFn = attrs.field(validator=attrs.validators.is_callable())
    make_state: StateFactory | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.is_callable())
    )
    source: str = "unknown"
    check_options: Callable[[Mapping[str, Any]], object] | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.is_callable())
    )

    def check(self, options: Mapping[str, Any]) -> None:
        """Validate ``options`` (``comm_state_option``) without building the state.

        Raises:
            ValueError: ``options`` is not empty but the hook takes no state options.
            TypeError, ValueError: from ``check_options``.
        """
        if self.make_state is None:
            if options:
                raise ValueError(
                    f"comm_state_option {dict(options)!r} given, but communication hook "
                    f"{self.name!r} (from {self.source}) takes no state options"
                )
        elif self.check_options is not None:
            self.check_options(options)

    def build_state(
        self, process_group: dist.ProcessGroup | None, options: Mapping[str, Any]
    ) -> Any:
        """Return the hook's state for ``process_group`` (``None`` = the default group).

        Raises:
            ValueError: ``options`` is not empty but the hook takes no state options.
        """
        if self.make_state is None:
            self.check(options)
            return process_group
        return self.make_state(process_group, options)


_REGISTRY: dict[str, CommHook] = {}


def register_comm_hook(
    name: str,
    hook: HookFn,
    *,
    make_state: StateFactory | None = None,
    check_options: Callable[[Mapping[str, Any]], object] | None = None,
    replace: bool = False,
) -> CommHook:
    """Register a DDP communication hook under ``name`` for this process.

    Args:
        name: non-empty name to use as ``DistributedDataParallelKwargs(comm_hook=name)``.
        hook: ``hook(state, bucket: torch.distributed.GradBucket) ->
            torch.futures.Future[torch.Tensor]``.
        make_state: optional ``make_state(process_group, comm_state_option) -> state``; without
            it the hook's state is the process group (``None`` = default group).
        check_options: optional ``check_options(comm_state_option) -> None`` validating the
            options without a process group (see :class:`CommHook`).
        replace: allow replacing a hook registered earlier under the same name.

    Returns:
        The :class:`CommHook` record.

    Raises:
        TypeError: ``hook`` or ``make_state`` is not callable, or ``name`` is not a ``str``.
        ValueError: ``name`` is empty or already registered (and ``replace`` is false).
    """
    if not isinstance(name, str) or not name:
        raise (ValueError if isinstance(name, str) else TypeError)(
            f"comm hook name must be a non-empty str, got {name!r}"
        )
    if name in _REGISTRY and not replace:
        raise ValueError(
            f"communication hook {name!r} is already registered; pass replace=True to replace it"
        )
    record = CommHook(
        name, hook, make_state, source="kwplug.register_comm_hook", check_options=check_options
    )
    _REGISTRY[name] = record
    return record


def unregister_comm_hook(name: str) -> None:
    """Remove the hook registered under ``name``; ``KeyError`` if there is none."""
    del _REGISTRY[name]


def registered_comm_hooks() -> Mapping[str, CommHook]:
    """Return a copy of the process-wide registry, by name."""
    return dict(_REGISTRY)


def merge_comm_hooks(
    contributions: list[tuple[str, Mapping[str, CommHook] | None]],
) -> dict[str, CommHook]:
    """Merge plugins' ``comm_hooks`` answers with the registry.

    Args:
        contributions: ``(plugin name, answer)`` pairs from the ``comm_hooks`` hook.

    Raises:
        TypeError: an answer is not a mapping of ``str`` to :class:`CommHook`.
        ValueError: two sources give the same name; the message names both.
    """

    def entry(plugin_name: str, name: Any, record: Any) -> tuple[CommHook, str]:
        if not isinstance(record, CommHook):
            raise TypeError(
                f"plugin {plugin_name!r}: comm_hooks()[{name!r}] must be a kwplug.CommHook, "
                f"got {type(record).__name__}"
            )
        if record.source == "unknown":
            record = attrs.evolve(record, source=plugin_name)
        return record, record.source

    return merge(
        "comm_hooks",
        contributions,
        entry=entry,
        label="communication hook",
        kind="kwplug.CommHook",
        remedy="block one of the plugins or rename the hook",
        start={name: (record, record.source) for name, record in _REGISTRY.items()},
    )

"""Everything an ``Accelerator`` resolves once, at construction, into one frozen :class:`_Setup`.

The plugin plumbing (building the manager, the conflict check, calling hooks, describing
plugins) is used only through :class:`_Plugins`, so that replacing that machinery changes this
class alone.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import pluggy
import torch
import torch.distributed as dist

from kwplug import discovery
from kwplug.comm_hooks import CommHook, merge_comm_hooks
from kwplug.conflicts import check_conflicts
from kwplug.dispatch import Answer, call_each, call_first
from kwplug.environment import ProcessInfo, end_process_group, select_device
from kwplug.handler import KwargsHandler
from kwplug.hookspecs import AutocastFactory
from kwplug.registry import build_plugin_manager, check_handler, check_handlers, extra_impls

logger = logging.getLogger(__name__)

MIXED_PRECISION = ("no", "fp16", "bf16")


@attrs.frozen
class _Plugins:
    """One Accelerator's plugin manager and what it knows about the registered plugins.

    Attributes:
        manager: the ``pluggy.PluginManager`` holding handlers, third-party and built-in
            plugins in precedence order.
        descriptions: registered plugin name -> words for messages.
        third_party: registered names of third-party default plugins.
    """

    manager: pluggy.PluginManager
    descriptions: Mapping[str, str]
    third_party: frozenset[str]

    @classmethod
    def build(cls, handlers: Sequence[KwargsHandler]) -> _Plugins:
        """Discover the installed plugins and register them after ``handlers``."""
        manager, descriptions, third_party = build_plugin_manager(handlers, discovery.discover())
        return cls(manager, descriptions, third_party)

    def _describe(self, name: str) -> str:
        return self.descriptions.get(name, name)

    def _check_conflicts(self, device_type: str) -> None:
        check_conflicts(self.manager, self.third_party.__contains__, device_type, self._describe)

    def _call_first(
        self,
        hook_name: str,
        *,
        extra: Sequence[Callable[..., Any]] = (),
        record: dict[str, Answer] | None = None,
        **kwargs: Any,
    ) -> Any:
        # ``record``: the plan that keeps who answered; per-call handlers pass None so that
        # they do not replace the set-up answers.
        answer = call_first(
            self.manager,
            hook_name,
            kwargs,
            extra=extra,
            describe=self._describe,
            third_party=self.third_party.__contains__,
        )
        if record is not None:
            record[hook_name] = answer
        logger.debug(
            "hook %s answered by %s", hook_name, self._describe(answer.plugin or "no plugin")
        )
        return answer.result

    def _call_each(
        self, hook_name: str, *, only: Callable[[str], bool] = lambda name: True, **kwargs: Any
    ) -> list[tuple[str, Any]]:
        return call_each(
            self.manager,
            hook_name,
            kwargs,
            describe=self._describe,
            third_party=self.third_party.__contains__,
            only=only,
        )

    def _call_with(
        self,
        hook_name: str,
        handler: KwargsHandler | None,
        *,
        record: dict[str, Answer] | None,
        **kwargs: Any,
    ) -> Any:
        # Without a handler this is the set-up call, recorded; with one, the handler's
        # implementation answers first, for this call only.
        if handler is None:
            return self._call_first(hook_name, record=record, **kwargs)
        check_handler(handler, f"the {hook_name} handler")
        extra = extra_impls(self.manager, handler, hook_name)
        return self._call_first(hook_name, extra=extra, **kwargs)


@attrs.frozen
class _Setup:
    """What an ``Accelerator`` resolved at construction; nothing here is looked up again.

    Attributes:
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``.
        handlers: the checked ``kwargs_handlers``.
        plugins: the plugin manager and its plugins' descriptions.
        process: ranks, read after the process group was initialised.
        device: where this process trains.
        comm_hooks: the merged named DDP communication hooks (passed to ``wrap_model``).
        autocast_factory: builds the autocast context (``contextlib.nullcontext`` when no
            plugin answered).
        scaler: the ``torch.amp.GradScaler``, or ``None``. It holds training state (the
            scale), so it belongs to one run.
        answers: who answered each set-up ``firstresult`` hook, in call order.
    """

    mixed_precision: str
    handlers: list[KwargsHandler]
    plugins: _Plugins
    process: ProcessInfo
    device: torch.device
    comm_hooks: dict[str, CommHook]
    autocast_factory: AutocastFactory
    scaler: torch.amp.GradScaler | None
    answers: Mapping[str, Answer]


def resolve(
    mixed_precision: str, cpu: bool, kwargs_handlers: Sequence[KwargsHandler] | None
) -> _Setup:
    """Check the arguments, build the plugins and call every set-up hook, in the documented
    order (docs/architecture.md, "Life of an Accelerator").

    Raises:
        ValueError: ``mixed_precision`` is not one of :data:`MIXED_PRECISION`; two handlers
            share a class; a torchrun variable is malformed.
        TypeError: ``cpu`` is not a bool; ``kwargs_handlers`` holds a non-handler.
        RuntimeError: ``WORLD_SIZE > 1`` but no plugin initialised the process group.
        kwplug.conflicts.PluginConflictError: two third-party default plugins claim a
            one-answer hook for this device.
    """
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(
            f"mixed_precision must be one of {', '.join(map(repr, MIXED_PRECISION))}, "
            f"got {mixed_precision!r}"
        )
    if not isinstance(cpu, bool):
        raise TypeError(f"cpu must be a bool, got {type(cpu).__name__}")
    handlers = check_handlers(kwargs_handlers)
    plugins = _Plugins.build(handlers)
    answers: dict[str, Answer] = {}

    info = ProcessInfo.current()
    device = select_device(cpu, info.local_rank)
    plugins._check_conflicts(device.type)
    comm_hooks = _collect_comm_hooks(plugins)
    plugins._call_each(
        "validate_setup",
        device_type=device.type,
        world_size=info.world_size,
        mixed_precision=mixed_precision,
        comm_hooks=comm_hooks,
    )
    if info.world_size > 1 and not dist.is_initialized():
        info = _init_process_group(plugins, answers, info, device.type)
    if info.world_size > 1:
        _destroy_process_group_at_exit()

    autocast_factory: AutocastFactory = (
        plugins._call_first(
            "autocast", record=answers, device_type=device.type, mixed_precision=mixed_precision
        )
        or contextlib.nullcontext
    )
    scaler: torch.amp.GradScaler | None = plugins._call_first(
        "make_scaler", record=answers, device_type=device.type, mixed_precision=mixed_precision
    )
    logger.debug(
        "Accelerator on %s, rank %d/%d, mixed_precision=%s, plugins: %s",
        device,
        info.rank,
        info.world_size,
        mixed_precision,
        list(plugins.descriptions.values()),
    )
    return _Setup(
        mixed_precision=mixed_precision,
        handlers=handlers,
        plugins=plugins,
        process=info,
        device=device,
        comm_hooks=comm_hooks,
        autocast_factory=autocast_factory,
        scaler=scaler,
        answers=answers,
    )


def _collect_comm_hooks(plugins: _Plugins) -> dict[str, CommHook]:
    # Answer by answer, so that a duplicate name can be blamed on the plugin that gave it.
    answers = plugins._call_each("comm_hooks")
    return merge_comm_hooks([(plugins._describe(name), answer) for name, answer in answers])


def _init_process_group(
    plugins: _Plugins, answers: dict[str, Answer], info: ProcessInfo, device_type: str
) -> ProcessInfo:
    done = plugins._call_first(
        "init_process_group",
        record=answers,
        device_type=device_type,
        world_size=info.world_size,
        rank=info.rank,
        local_rank=info.local_rank,
    )
    if not done or not dist.is_initialized():
        raise RuntimeError(
            f"WORLD_SIZE={info.world_size} but no plugin initialised the process group "
            "(the built-in InitProcessGroupKwargs plugin may be blocked)"
        )
    return ProcessInfo.current()


@functools.cache
def _destroy_process_group_at_exit() -> None:
    # Once per process. atexit runs before interpreter teardown frees gloo's objects in an
    # arbitrary order; a no-op when end_training() already destroyed the group.
    atexit.register(end_process_group)

"""Typed hook relays: ``plugins.first.<hook>(...)`` and ``plugins.each.<hook>(...)``.

A hook call names its hook as an attribute and its arguments as keywords, so that a type
checker sees every call site: ``mypy --strict`` flags a misspelt hook, a missing or misspelt
argument, a wrong argument type and a ``first`` call of a collecting hook; at run time Python
itself raises ``TypeError`` naming the hook and the argument (``FirstRelay.autocast() missing 1
required keyword-only argument: 'mixed_precision'``).

- :class:`FirstRelay` has one method per one-answer (``firstresult``) hook of
  :class:`~kwplug.hookspecs.HandlerSpec`: it returns the first non-``None`` answer, or
  ``None`` when every plugin declined; who answered is in the manager's ``plan`` (not for a
  per-call handler's relay, ``plugins.first_with(handler)``).
- :class:`EachRelay` has one method per collecting hook: it returns ``(registered name,
  answer)`` for each plugin called, in call order, ``None`` answers included (callers name the
  plugin that gave an answer, or store answers under it); ``plugins.each_of(name)`` asks one
  plugin.

The methods mirror the specs: same names, the spec's parameters keyword-only with the spec's
annotations, return types derived from the spec's (``first``: the spec's own, ``X | None``;
``each``: ``list[tuple[str, <spec's>]]``). ``tests/plugin_system/test_relays.py`` checks them
against :class:`~kwplug.hookspecs.HandlerSpec` with :mod:`inspect`, so the two cannot drift.
Each method hands ``(hook name, arguments)`` to its relay's ``ask`` -- a method of the
manager's one :class:`~kwplug._plugins._calls.HookCalls` -- and returns what it answers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from kwplug.comm_hooks import CommHook
    from kwplug.hookspecs import AutocastFactory, DeviceChoice
    from kwplug.precision import LossScaler
    from kwplug.tracking import TrackerFactory

#: ``ask(hook name, keyword arguments)``: runs the call and answers.
Ask = Callable[[str, dict[str, Any]], Any]


class FirstRelay:
    """The one-answer hooks: each method returns the first non-``None`` answer, or ``None``.

    Raises (every method):
        kwplug.errors.PluginHookError: a third-party implementation raised.
        Exception: whatever a built-in or user handler's implementation raised (with a note
            naming it, on Python >= 3.11).
    """

    __slots__ = ("_ask",)

    def __init__(self, ask: Ask) -> None:
        """A relay whose calls go to ``ask``."""
        self._ask = ask

    def autocast(self, *, device_type: str, mixed_precision: str) -> AutocastFactory | None:
        """Ask ``autocast`` (see :meth:`kwplug.hookspecs.HandlerSpec.autocast`)."""
        answer: AutocastFactory | None = self._ask(
            "autocast", {"device_type": device_type, "mixed_precision": mixed_precision}
        )
        return answer

    def wrap_model(
        self,
        *,
        model: torch.nn.Module,
        device: torch.device,
        device_type: str,
        world_size: int,
        mixed_precision: str,
        comm_hooks: Mapping[str, CommHook],
        device_mesh: DeviceMesh | None,
    ) -> torch.nn.Module | None:
        """Ask ``wrap_model`` (see :meth:`kwplug.hookspecs.HandlerSpec.wrap_model`)."""
        answer: torch.nn.Module | None = self._ask(
            "wrap_model",
            {
                "model": model,
                "device": device,
                "device_type": device_type,
                "world_size": world_size,
                "mixed_precision": mixed_precision,
                "comm_hooks": comm_hooks,
                "device_mesh": device_mesh,
            },
        )
        return answer

    def device_mesh(self, *, device_type: str, world_size: int) -> DeviceMesh | None:
        """Ask ``device_mesh`` (see :meth:`kwplug.hookspecs.HandlerSpec.device_mesh`)."""
        answer: DeviceMesh | None = self._ask(
            "device_mesh", {"device_type": device_type, "world_size": world_size}
        )
        return answer

    def make_scaler(self, *, device_type: str, mixed_precision: str) -> LossScaler | None:
        """Ask ``make_scaler`` (see :meth:`kwplug.hookspecs.HandlerSpec.make_scaler`)."""
        answer: LossScaler | None = self._ask(
            "make_scaler", {"device_type": device_type, "mixed_precision": mixed_precision}
        )
        return answer

    def init_process_group(
        self, *, device_type: str, world_size: int, rank: int, local_rank: int
    ) -> bool | None:
        """Ask ``init_process_group`` (see
        :meth:`kwplug.hookspecs.HandlerSpec.init_process_group`)."""
        answer: bool | None = self._ask(
            "init_process_group",
            {
                "device_type": device_type,
                "world_size": world_size,
                "rank": rank,
                "local_rank": local_rank,
            },
        )
        return answer

    def make_profiler(self, *, device_type: str, rank: int) -> torch.profiler.profile | None:
        """Ask ``make_profiler`` (see :meth:`kwplug.hookspecs.HandlerSpec.make_profiler`)."""
        answer: torch.profiler.profile | None = self._ask(
            "make_profiler", {"device_type": device_type, "rank": rank}
        )
        return answer

    def no_sync(self, *, model: torch.nn.Module) -> AbstractContextManager[Any] | None:
        """Ask ``no_sync`` (see :meth:`kwplug.hookspecs.HandlerSpec.no_sync`)."""
        answer: AbstractContextManager[Any] | None = self._ask("no_sync", {"model": model})
        return answer

    def sync_in_backward(self, *, model: torch.nn.Module) -> AbstractContextManager[Any] | None:
        """Ask ``sync_in_backward`` (see
        :meth:`kwplug.hookspecs.HandlerSpec.sync_in_backward`)."""
        answer: AbstractContextManager[Any] | None = self._ask("sync_in_backward", {"model": model})
        return answer

    def compile_model(self, *, model: torch.nn.Module) -> torch.nn.Module | None:
        """Ask ``compile_model`` (see :meth:`kwplug.hookspecs.HandlerSpec.compile_model`)."""
        answer: torch.nn.Module | None = self._ask("compile_model", {"model": model})
        return answer

    def select_device(self, *, cpu: bool, local_rank: int, world_size: int) -> DeviceChoice | None:
        """Ask ``select_device`` (see :meth:`kwplug.hookspecs.HandlerSpec.select_device`)."""
        answer: DeviceChoice | None = self._ask(
            "select_device", {"cpu": cpu, "local_rank": local_rank, "world_size": world_size}
        )
        return answer


class EachRelay:
    """The collecting hooks: each method returns ``(registered name, answer)`` per plugin
    called, in call order (``None`` answers included).

    Raises (every method): as :class:`FirstRelay`'s.
    """

    __slots__ = ("_ask",)

    def __init__(self, ask: Ask) -> None:
        """A relay whose calls go to ``ask``."""
        self._ask = ask

    def comm_hooks(self) -> list[tuple[str, Mapping[str, CommHook] | None]]:
        """Ask ``comm_hooks`` (see :meth:`kwplug.hookspecs.HandlerSpec.comm_hooks`)."""
        answers: list[tuple[str, Mapping[str, CommHook] | None]] = self._ask("comm_hooks", {})
        return answers

    def trackers(self) -> list[tuple[str, Mapping[str, TrackerFactory] | None]]:
        """Ask ``trackers`` (see :meth:`kwplug.hookspecs.HandlerSpec.trackers`)."""
        answers: list[tuple[str, Mapping[str, TrackerFactory] | None]] = self._ask("trackers", {})
        return answers

    def unwrap_model(self, *, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module | None]]:
        """Ask ``unwrap_model`` (see :meth:`kwplug.hookspecs.HandlerSpec.unwrap_model`)."""
        answers: list[tuple[str, torch.nn.Module | None]] = self._ask(
            "unwrap_model", {"model": model}
        )
        return answers

    def validate_setup(
        self,
        *,
        device_type: str,
        world_size: int,
        mixed_precision: str,
        comm_hooks: Mapping[str, CommHook],
    ) -> list[tuple[str, None]]:
        """Ask ``validate_setup`` (see :meth:`kwplug.hookspecs.HandlerSpec.validate_setup`)."""
        answers: list[tuple[str, None]] = self._ask(
            "validate_setup",
            {
                "device_type": device_type,
                "world_size": world_size,
                "mixed_precision": mixed_precision,
                "comm_hooks": comm_hooks,
            },
        )
        return answers

    def handler_state(self) -> list[tuple[str, Mapping[str, Any] | None]]:
        """Ask ``handler_state`` (see :meth:`kwplug.hookspecs.HandlerSpec.handler_state`)."""
        answers: list[tuple[str, Mapping[str, Any] | None]] = self._ask("handler_state", {})
        return answers

    def load_handler_state(self, *, state: Mapping[str, Any]) -> list[tuple[str, None]]:
        """Ask ``load_handler_state`` (see
        :meth:`kwplug.hookspecs.HandlerSpec.load_handler_state`)."""
        answers: list[tuple[str, None]] = self._ask("load_handler_state", {"state": state})
        return answers

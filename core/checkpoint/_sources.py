"""What a save or a load reads of the training run: :class:`CheckpointSources`.

The checkpoint package never sees the ``Accelerator``: for each ``save_state``/``load_state``
call the Accelerator builds one frozen :class:`CheckpointSources` holding the objects to save
or restore and the few facts about the run the package needs (ranks, device, how to unwrap a
model, the plugins' ``handler_state``/``load_handler_state`` callers, the project
configuration for automatic naming). As torchtitan's ``CheckpointManager``, which is given its
model parts, optimizers and states, so that the checkpoint code can change (or be tested)
without the trainer and the trainer without it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import torch
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from kwplug.checkpoint._arrival import SaveArrivals
from kwplug.checkpoint._runs import RunIdentity
from kwplug.errors import CheckpointError, NotCheckpointableError
from kwplug.optimizer import AcceleratedOptimizer, ScalerUpdates
from kwplug.utils.dataclasses import ProjectConfiguration

if TYPE_CHECKING:  # torch's protocol: state_dict() and load_state_dict(state)
    from torch.distributed.checkpoint.stateful import Stateful

SaveHook = Callable[[list[torch.nn.Module], list[dict[str, Any]], str], None]
LoadHook = Callable[[list[torch.nn.Module], str], None]


class GradientPosition(Protocol):
    """Where gradient accumulation is (the Accelerator's ``GradientState``), as read here."""

    @property
    def sync_gradients(self) -> bool:
        """False between two micro-batches of an accumulation."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The position (``{"step": int, "sync_gradients": bool}``)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a position from :meth:`state_dict`."""
        ...


@attrs.define
class StatePreHooks:
    """An Accelerator's ``save_state``/``load_state`` pre-hooks (run by
    :mod:`kwplug.checkpoint._prehooks`), by ``RemovableHandle`` id (``OrderedDict``s: the
    handle holds a weak reference to its dict, which a plain ``dict`` cannot have)."""

    save: OrderedDict[int, SaveHook] = attrs.Factory(OrderedDict)
    load: OrderedDict[int, LoadHook] = attrs.Factory(OrderedDict)

    def register_save(self, hook: SaveHook) -> RemovableHandle:
        """Add a save hook; ``remove()`` on the returned handle takes it out.

        Raises:
            TypeError: ``hook`` is not callable.
        """
        return _register(self.save, hook)

    def register_load(self, hook: LoadHook) -> RemovableHandle:
        """Add a load hook; ``remove()`` on the returned handle takes it out.

        Raises:
            TypeError: ``hook`` is not callable.
        """
        return _register(self.load, hook)


def _register(hooks: OrderedDict[int, Any], hook: Callable[..., None]) -> RemovableHandle:
    if not callable(hook):
        raise TypeError(f"a state pre-hook must be callable, got {type(hook).__qualname__}")
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


@attrs.frozen(kw_only=True)
class CheckpointSources:
    """Everything one ``save_state``/``load_state`` call reads of the run (built per call).

    Attributes:
        models: the prepared models, as prepared (wrapped: DDP...), in preparation order.
        optimizers: the prepared optimizers (``AcceleratedOptimizer``), in order.
        dataloaders: the prepared data loaders, in order.
        custom_objects: the objects registered for checkpointing (prepared schedulers too).
        scaler: the gradient scaler (fp16), or ``None``.
        scaler_updates: the ``GradScaler.update()`` the optimizers share, or ``None``.
        gradient_state: where gradient accumulation is.
        pre_hooks: the registered ``save_state``/``load_state`` pre-hooks.
        process_index: this process's global rank.
        num_processes: the world size.
        device: this process's device (its RNG state is saved).
        unwrap: the user's module inside a prepared model (``Accelerator.unwrap_model``).
        handler_state: every plugin's ``handler_state`` answer, by plugin name.
        load_handler_state: gives each plugin named in the mapping its saved state back.
        project_configuration: the run's ``ProjectConfiguration`` (automatic naming; its
            ``iteration`` is advanced by each save and set by a load).
        run: the id automatic naming tags this run's checkpoints with (the Accelerator's,
            kept across calls; :mod:`kwplug.checkpoint._runs`).
        arrivals: whether the Accelerator's saves are made by the main process alone (kept
            across calls; :mod:`kwplug.checkpoint._arrival`).
        solo: this call is a save by the main process alone: no collective is entered.
        exact_data_position: a load restores the prepared loaders' mid-epoch positions
            (``load_state(..., exact_data_position=True)``); else they start the saved epoch
            at batch 0, as Accelerate's (:mod:`kwplug.checkpoint._position`).
        state_dict_type: how sharded models are saved, as the plugin that sharded them
            says (its ``state_dict_type``): ``"SHARDED_STATE_DICT"`` (each rank its shards,
            :mod:`kwplug.checkpoint._dcp`; ``None`` means it, Accelerate's FSDP2 default) or
            ``"FULL_STATE_DICT"`` (gathered to rank 0, :mod:`kwplug.checkpoint._sharded`).
        agree: called with ``"save_state"`` by a save every rank takes part in, once all have
            arrived and before anything is written: the Accelerator's rank agreement (raises
            ``RankMismatchError`` on every rank when a setting differs); a no-op by default.
    """

    models: tuple[torch.nn.Module, ...]
    optimizers: tuple[AcceleratedOptimizer, ...]
    dataloaders: tuple[DataLoader[Any], ...]
    custom_objects: tuple[Stateful, ...]
    scaler: Stateful | None
    scaler_updates: ScalerUpdates | None
    gradient_state: GradientPosition
    pre_hooks: StatePreHooks
    process_index: int
    num_processes: int
    device: torch.device
    unwrap: Callable[[torch.nn.Module], torch.nn.Module]
    handler_state: Callable[[], dict[str, Any]]
    load_handler_state: Callable[[Mapping[str, Any]], None]
    project_configuration: ProjectConfiguration
    run: RunIdentity = attrs.field(factory=RunIdentity)
    arrivals: SaveArrivals = attrs.field(factory=SaveArrivals)
    solo: bool = False
    exact_data_position: bool = False
    state_dict_type: Any = None
    agree: Callable[[str], None] = lambda at: None

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0 (which writes the shared files and commits)."""
        return self.process_index == 0

    def modules(self) -> list[torch.nn.Module]:
        """The prepared models, unwrapped (what their ``state_dict`` is taken of)."""
        return [self.unwrap(model) for model in self.models]

    @property
    def collective(self) -> bool:
        """True when this call's ranks meet in collectives (several processes, and not a
        save by the main process alone, whose peers are not in ``save_state``)."""
        return self.num_processes > 1 and not self.solo

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (``all_gather_object``; ``[value]`` without
        a collective), so that all ranks act, and raise, together instead of hanging apart."""
        if not self.collective:
            return [value]
        values: list[Any] = [None] * self.num_processes
        torch.distributed.all_gather_object(values, value)
        return values

    def raise_together(self, error: CheckpointError | None, what: str, folder: Path) -> None:
        """Raise on every rank when any rank failed (a collective: :meth:`gather`).

        Args:
            error: this rank's refusal, or ``None``.
            what: the words before ``folder`` in another rank's refusal raised here
                (``"another rank refused"``).
            folder: the checkpoint folder, named in the message and as ``.file``.

        Raises:
            CheckpointError: ``error`` itself on the rank that had it; on the others,
                ``"<what> <folder>: <the first failing rank's message>"``.
        """
        others = [e for e in self.gather(None if error is None else str(error)) if e is not None]
        if error is not None:
            raise error
        if others:
            raise CheckpointError(f"{what} {folder}: {others[0]}", folder)

    def from_main(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (``broadcast_object_list``): the main process
        decides, every rank acts on its decision."""
        if not self.collective:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]


def register(registry: list[Any], *objects: Any) -> None:
    """Append ``objects`` to ``registry`` (an Accelerator's registered objects), each checked.

    Raises:
        kwplug.errors.NotCheckpointableError: (a ``ValueError``, as Accelerate's, and a
            ``TypeError``) an object lacks a callable ``state_dict`` or ``load_state_dict``;
            the message lists each one by index, and none of ``objects`` is registered.
    """
    invalid = [
        i
        for i, obj in enumerate(objects)
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        )
    ]
    if invalid:
        listed = "".join(
            f"\n\t- Item at index {i}, `{type(objects[i]).__qualname__}`" for i in invalid
        )
        raise NotCheckpointableError(
            "All `objects` must include a `state_dict` and `load_state_dict` function to be "
            f"stored. The following inputs are invalid:{listed}",
            indices=tuple(invalid),
        )
    registry.extend(objects)

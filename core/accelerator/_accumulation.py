"""Gradient accumulation: the per-Accelerator :class:`GradientState` and the Accelerator
methods built on it (``accumulate``, ``no_sync``, ``sync_gradients``, schedulers, clipping).

The methods live in :class:`_GradientAccumulation`, a base class of ``Accelerator``, so that
the facade stays short; they are public methods of ``Accelerator``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import torch

from kwplug.accelerator import _join
from kwplug.data import ActiveLoaders
from kwplug.utils.dataclasses import GradientAccumulationPlugin, ProjectConfiguration

if TYPE_CHECKING:
    from kwplug.accelerator._prepare import _Prepared
    from kwplug.accelerator._setup import _Setup
    from kwplug.scheduler import AcceleratedScheduler

_T = TypeVar("_T")


def _check_steps(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"gradient_accumulation_steps must be an int >= 1, got {value!r} of type "
            f"{type(value).__name__}"
        )
    if value < 1:
        raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {value!r}")
    return value


@attrs.define(eq=False)
class GradientState:
    """Where one Accelerator is in a gradient accumulation (Accelerate's ``GradientState``,
    one per Accelerator instead of a process-wide singleton).

    Attributes:
        plugin_kwargs: the options given through ``GradientAccumulationPlugin`` (its
            ``to_kwargs()``: the fields that differ from the defaults, as Accelerate keeps
            them, so an option is in effect only when given).
        sync_gradients: whether the current step ends with an optimizer step (``True``
            outside ``accumulate()``).
        step: micro-batches since the last synchronising step.
        loaders: the prepared data loaders being iterated (they register themselves), whose
            last batch forces a synchronising step.
    """

    plugin_kwargs: dict[str, Any] = attrs.Factory(dict)
    sync_gradients: bool = True
    step: int = 0
    loaders: ActiveLoaders = attrs.Factory(ActiveLoaders)

    @classmethod
    def from_plugin(cls, plugin: GradientAccumulationPlugin) -> GradientState:
        """The state for ``plugin`` (``num_steps=None`` means 1)."""
        return cls(plugin_kwargs=plugin.to_kwargs())

    @property
    def num_steps(self) -> int:
        """Micro-batches per optimizer step (``gradient_accumulation_steps``)."""
        return int(self.plugin_kwargs.get("num_steps") or 1)

    @num_steps.setter
    def num_steps(self, value: int) -> None:
        self.plugin_kwargs["num_steps"] = _check_steps(value)

    @property
    def adjust_scheduler(self) -> bool:
        """Count accumulation steps in prepared schedulers' ``_step_count`` (only when
        ``adjust_scheduler=True`` was given explicitly, as in Accelerate)."""
        return bool(self.plugin_kwargs.get("adjust_scheduler", False))

    @property
    def sync_with_dataloader(self) -> bool:
        """The last batch of a prepared data loader forces a synchronising step."""
        return bool(self.plugin_kwargs.get("sync_with_dataloader", True))

    @property
    def sync_each_batch(self) -> bool:
        """Synchronise gradients on every micro-batch (the optimizer still waits)."""
        return bool(self.plugin_kwargs.get("sync_each_batch", False))

    @property
    def active_loader(self) -> Any:
        """The innermost prepared data loader being iterated, or ``None``."""
        return self.loaders.active

    @property
    def active_dataloader(self) -> Any:
        """Accelerate's name of :attr:`active_loader`: the innermost prepared data loader
        being iterated, or ``None``."""
        return self.loaders.active

    @property
    def in_dataloader(self) -> bool:
        """Whether a prepared data loader is being iterated."""
        return self.loaders.active is not None

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the active loader is handing out its last batch of the epoch (prepared
        loaders read one batch ahead to know, as Accelerate's do)."""
        return self.loaders.end_of_dataloader

    def state_dict(self) -> dict[str, Any]:
        """The position in the accumulation, for a checkpoint taken mid-accumulation
        (``{"step": int, "sync_gradients": bool}``)."""
        return {"step": self.step, "sync_gradients": self.sync_gradients}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a position from :meth:`state_dict`."""
        self.step, self.sync_gradients = int(state["step"]), bool(state["sync_gradients"])

    def restart(self) -> None:
        """Forget the micro-batches counted so far (``Accelerator.free_memory``/``clear``, as
        Accelerate's ``free_memory`` resets its step): the next accumulation starts afresh."""
        self.step = 0

    def do_sync(self) -> None:
        """Advance one micro-batch: synchronise every ``num_steps``-th one, and at the end of
        a prepared data loader (which also restarts the count)."""
        if self.sync_with_dataloader and self.end_of_dataloader:
            self.step = 0
            self.sync_gradients = True
        else:
            self.step += 1
            self.sync_gradients = self.step % self.num_steps == 0


class _GradientAccumulation:
    """The Accelerator's gradient accumulation methods (a base class of ``Accelerator``)."""

    _setup: _Setup
    _prepared: _Prepared
    gradient_state: GradientState
    project_configuration: ProjectConfiguration
    distributed_type: Any  # the facade's property (._process_api)

    @property
    def project_dir(self) -> str | None:
        """``project_configuration.project_dir``: the folder for checkpoints, or ``None``."""
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        """``project_configuration.logging_dir``: the folder for trackers' logs, or ``None``."""
        return self.project_configuration.logging_dir

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """Run one micro-batch of a gradient accumulation.

        Each entry counts a micro-batch; every ``gradient_accumulation_steps``-th one, and the
        last batch of a prepared data loader, is a synchronising step (:attr:`sync_gradients`).
        On the others the ``models`` skip gradient synchronisation (:meth:`no_sync`, unless
        ``sync_each_batch``), and prepared optimizers and schedulers skip ``step`` and
        ``zero_grad``. :meth:`backward` divides the loss by the number of steps.

        Args:
            models: prepared models whose gradient synchronisation is suppressed on
                non-synchronising steps.
        """
        state = self.gradient_state
        state.do_sync()
        skip = not state.sync_gradients and not (
            self._setup.process.world_size > 1 and state.sync_each_batch
        )
        with contextlib.ExitStack() as stack:
            if skip:
                for model in models:
                    stack.enter_context(self.no_sync(model))
            yield

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """A context in which ``model``'s backward passes accumulate local gradients without
        synchronising them across processes.

        The context comes from the ``no_sync`` hook: ``DistributedDataParallel.no_sync()`` for
        a DDP model (built-in DDP handler), ``set_requires_gradient_sync(False)`` for an FSDP2
        model (kwplug-fsdp); ``contextlib.nullcontext()`` when no plugin answers (a model that
        is not wrapped).
        """
        context = self._setup.plugins.first.no_sync(model=model)
        return contextlib.nullcontext() if context is None else context

    def trigger_sync_in_backward(
        self, model: torch.nn.Module
    ) -> contextlib.AbstractContextManager[Any]:
        """A context in which the next backward of ``model`` synchronises the gradients it
        accumulated, although its forward ran under :meth:`no_sync` (Accelerate's method of
        the same name; here an instance method).

        The context comes from the ``sync_in_backward`` hook (the built-in DDP handler
        re-arms ``DistributedDataParallel``'s reducer); ``contextlib.nullcontext()`` when no
        plugin answers (a single process, a model that is not wrapped).
        """
        return _join.sync_in_backward(self._setup.plugins, model)

    def join_uneven_inputs(
        self, joinables: Any, even_batches: bool | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """A context for training or evaluating on inputs of uneven length across processes:
        ``torch.distributed.algorithms.Join`` over ``joinables``, so that a rank out of
        batches shadows the others' collectives instead of hanging.

        Join is enabled only when the batches are uneven: with ``even_batches`` (default:
        ``dataloader_config.even_batches``) every rank gets as many batches. A given
        ``even_batches`` overrides the prepared map-style data loaders' setting inside the
        context (iterable-style ones keep theirs, with a warning). In one process it does
        nothing; with joinables that are not torch ``Joinable`` (a model not wrapped in
        DDP), or a ``distributed_type`` other than data parallelism (``FSDP``), it warns
        (``KwplugWarning``) and does nothing, as Accelerate.

        Args:
            joinables: the DDP models (and ``ZeroRedundancyOptimizer`` s) to join.
            even_batches: ``bool`` overriding the loaders' ``even_batches``; ``None``
                (default) keeps it.
        """
        return _join.join_uneven_inputs(
            world_size=self._setup.process.world_size,
            loaders=self._prepared.dataloaders,
            default_even_batches=self._prepared.dataloader_config.even_batches,
            joinables=joinables,
            even_batches=even_batches,
            distributed_type=self.distributed_type.value,
        )

    @property
    def sync_gradients(self) -> bool:
        """Whether the current step synchronises gradients and steps the optimizers."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step; setting it takes effect at the next
        :meth:`accumulate`.

        Raises:
            TypeError, ValueError: (setter) not an ``int`` >= 1.
        """
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.gradient_state.num_steps = value

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)`` of ``loss / gradient_accumulation_steps``, scaled by the
        loss scaler (:meth:`kwplug.precision.LossScaler.scale`) when there is one."""
        steps = self.gradient_state.plugin_kwargs.get("num_steps")  # = num_steps, inline
        if steps and steps > 1:
            loss = loss / int(steps)
        updates = self._prepared.scaler_updates
        if updates is None:
            if kwargs:
                loss.backward(**kwargs)  # type: ignore[no-untyped-call]
            else:
                loss.backward()  # type: ignore[no-untyped-call]
            return
        updates.flush()  # the previous step's pending update() of the loss scaler
        updates.backend.scale(loss).backward(**kwargs)  # type: ignore[no-untyped-call]

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether a prepared optimizer's last step was skipped because of inf/NaN gradients
        (fp16); the learning rate should then not change."""
        return any(getattr(opt, "step_was_skipped", False) for opt in self._prepared.optimizers)

    def prepare_scheduler(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> Any:
        """Wrap ``scheduler`` in an :class:`~kwplug.scheduler.AcceleratedScheduler` (stepped
        once per process per optimizer step, see there) and save it with :meth:`save_state`.
        """
        wrapped: AcceleratedScheduler = self._prepared.scheduler(scheduler)
        return wrapped

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscale the gradients of prepared optimizers (the loss scaler's ``unscale_``), once per
        optimizer step; nothing without a loss scaler.

        Args:
            optimizer: a prepared optimizer (or the optimizer it wraps), or a list of them;
                default ``None``: every prepared optimizer (as Accelerate).

        Raises:
            ValueError: an optimizer that this Accelerator did not prepare.
        """
        prepared = self._prepared.optimizers
        if optimizer is None:
            chosen = list(prepared)
        else:
            wanted = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
            chosen = []
            for item in wanted:
                match = [o for o in prepared if item is o or item is o.optimizer]
                if not match:
                    raise ValueError(
                        f"unscale_gradients: {type(item).__name__} was not prepared by this "
                        "Accelerator (pass the optimizer prepare() returned)"
                    )
                chosen.extend(match)
        for optimizer in chosen:
            unscale = getattr(optimizer, "unscale_gradients", None)
            if unscale is not None:
                unscale()

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the unscaled gradients.

        On a synchronising step the gradients are unscaled first (fp16; once per step, however
        often this is called) and clipped. While gradients accumulate
        (:attr:`sync_gradients` false) they are left alone -- they are partial, and scaled
        under fp16 -- and the norm they have so far is returned.

        Returns:
            The total gradient norm before clipping (a 0-d tensor).
        """
        parameters = list(parameters)
        if self.gradient_state.sync_gradients:
            self.unscale_gradients()
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        norm = torch.nn.utils.clip_grad_norm_(parameters, float("inf"), norm_type=norm_type)
        backend = self._setup.scaler
        return norm / backend.get_scale() if backend is not None else norm

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """``torch.nn.utils.clip_grad_value_`` of the unscaled gradients, on a synchronising
        step (the gradients are unscaled first under fp16); nothing while they accumulate."""
        if self.gradient_state.sync_gradients:
            self.unscale_gradients()
            torch.nn.utils.clip_grad_value_(parameters, clip_value)

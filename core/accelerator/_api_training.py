"""The Accelerator's training-step methods: gradient accumulation (``accumulate``,
``no_sync``, ``sync_gradients``, ``gradient_accumulation_steps``), ``backward``, gradient
clipping and unscaling, ``trigger_sync_in_backward`` and ``join_uneven_inputs``.

The methods live in :class:`_TrainingAPI`, a base class of ``Accelerator``, so that the facade
stays short; they are public methods of ``Accelerator``. The state they work on is the
Accelerator's :class:`~kwplug.accelerator._gradient_state.GradientState`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from kwplug.accelerator import _join
from kwplug.accelerator._clip import clip_grad_norm
from kwplug.accelerator._sync_off import SyncOff

if TYPE_CHECKING:
    from kwplug.accelerator._agreement import LiveAgreement
    from kwplug.accelerator._gradient_state import GradientState
    from kwplug.accelerator._prepare import _Prepared
    from kwplug.accelerator._setup import _Setup


class _TrainingAPI:
    """The Accelerator's training-step methods (a base class of ``Accelerator``)."""

    _setup: _Setup
    _prepared: _Prepared
    _agreement: LiveAgreement
    gradient_state: GradientState
    distributed_type: Any  # the facade's property (._api_process)
    _sync_off: SyncOff | None = None  # accumulate's no_sync contexts, made at first need

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """Run one micro-batch of a gradient accumulation.

        Each entry counts a micro-batch; every ``gradient_accumulation_steps``-th one, and the
        last batch of a prepared data loader, is a synchronising step (:attr:`sync_gradients`).
        On the others the ``models`` skip gradient synchronisation (:meth:`no_sync`, unless
        ``sync_each_batch``), and prepared optimizers and schedulers skip ``step`` and
        ``zero_grad``. :meth:`backward` divides the loss by the number of steps.

        The ``no_sync`` hook is asked once per model; while kwplug's own implementations
        alone answer it and nothing traces the plugin manager, later micro-batches call the
        implementation that answered directly, or enter nothing when none did (one process,
        an unwrapped model), as Accelerate does (:mod:`kwplug.accelerator._sync_off`).

        Args:
            models: prepared models whose gradient synchronisation is suppressed on
                non-synchronising steps.
        """
        state = self.gradient_state
        state.do_sync()
        if (
            state.sync_gradients
            or not models
            or (self._setup.process.world_size > 1 and state.sync_each_batch)
        ):
            yield
            return
        # The no_sync hook once per model, then no hook call where kwplug's own
        # implementations alone answer it (._sync_off says when).
        sync_off = self._sync_off
        if sync_off is None:
            sync_off = self._sync_off = SyncOff(self._setup.plugins)
        overridden = type(self).no_sync is not _TrainingAPI.no_sync  # a subclass's: call it
        with contextlib.ExitStack() as stack:
            for model in models:
                context = self.no_sync(model) if overridden else sync_off.context(model)
                if context is not None:
                    stack.enter_context(context)
            yield

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """A context in which ``model``'s backward passes accumulate local gradients without
        synchronising them across processes.

        The context comes from the ``no_sync`` hook: ``DistributedDataParallel.no_sync()`` for
        a DDP model (built-in DDP handler), ``set_requires_gradient_sync(False)`` for an FSDP2
        model (kwplug-fsdp); ``contextlib.nullcontext()`` when no plugin answers (a model that
        is not wrapped).
        """
        context = self._setup.plugins.first.no_sync(model=_join.hook_target(model))
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
        loss scaler (:meth:`kwplug.precision.LossScaler.scale`) when there is one.

        The first call after a ``prepare`` of a model compares the ranks' settings as they
        are now (:class:`kwplug.accelerator._agreement.LiveAgreement`); later calls read one
        flag.

        Raises:
            kwplug.errors.RankMismatchError: (first call, every rank) a setting differs.
        """
        if self._agreement.backward_due:
            self._agreement.backward_due = False
            self._agreement.check("backward")
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

        Gradients that are ``DTensor`` objects (FSDP2 shards, tensor-parallel parameters) count
        whole: the norm is the unsharded model's (:mod:`kwplug.accelerator._clip`).

        Returns:
            The total gradient norm before clipping (a 0-d tensor).
        """
        parameters = list(parameters)
        if self.gradient_state.sync_gradients:
            self.unscale_gradients()
            return clip_grad_norm(parameters, max_norm, norm_type)
        norm = clip_grad_norm(parameters, float("inf"), norm_type)
        backend = self._setup.scaler
        return norm / backend.get_scale() if backend is not None else norm

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """``torch.nn.utils.clip_grad_value_`` of the unscaled gradients, on a synchronising
        step (the gradients are unscaled first under fp16); nothing while they accumulate."""
        if self.gradient_state.sync_gradients:
            self.unscale_gradients()
            torch.nn.utils.clip_grad_value_(parameters, clip_value)

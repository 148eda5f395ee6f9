"""The public ``Accelerator``: each method delegates to the setup resolved at construction
(:mod:`._setup`), the prepared-object registry (:mod:`._prepare`), the collectives
(:mod:`._ops`) or checkpointing (:mod:`._checkpointing`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader

from kwplug._plugins import Answer, KwplugPluginManager
from kwplug.accelerator import _checkpointing, _metrics, _ops
from kwplug.accelerator._prepare import _Prepared, unwrap_model
from kwplug.accelerator._process_api import _DataAndProcessAPI
from kwplug.accelerator._setup import _Setup, resolve
from kwplug.comm_hooks import CommHook
from kwplug.environment import end_process_group
from kwplug.handler import KwargsHandler
from kwplug.optimizer import ScaledOptimizer
from kwplug.utils.dataclasses import DataLoaderConfiguration


class Accelerator(_DataAndProcessAPI):
    """Runs a training loop on the device and processes chosen by torchrun, through plugins.

    Every torch object it builds -- the process group, the autocast context, the gradient
    scaler, the model wrapper (DDP) and the profiler -- comes from a hook call
    (:mod:`kwplug.hookspecs`), answered first by the handlers in ``kwargs_handlers``, then by
    third-party plugins, then by kwplug's built-ins. Hooks are called here and in
    :meth:`prepare`, never per training step.

    Args:
        mixed_precision: ``"no"`` (default), ``"fp16"`` (``torch.autocast`` to float16 and a
            ``torch.amp.GradScaler``) or ``"bf16"`` (autocast to bfloat16, no scaler). Works
            on CPU too.
        cpu: train on the CPU even when an accelerator is available.
        kwargs_handlers: handler instances (``AutocastKwargs``, ``DistributedDataParallelKwargs``,
            ``GradScalerKwargs``, ``InitProcessGroupKwargs``, ``ProfileKwargs``, a subclass of
            one, or a third-party handler), at most one per class.
        dataloader_config: how :meth:`prepare` shards data loaders
            (:class:`~kwplug.utils.DataLoaderConfiguration`; default: its defaults).

    Data-loader, metrics and process-control methods (``gather_for_metrics``,
    ``main_process_first``, ``on_main_process``, ``state``...) come from ``_DataAndProcessAPI``.

    Attributes:
        device: the ``torch.device`` this process trains on (``device_type``: its type).
        num_processes: ``WORLD_SIZE``; ``process_index`` / ``local_process_index``: the
            global / node-local rank.
        scaler: the ``torch.amp.GradScaler`` (fp16), or ``None``.
        comm_hooks: the named DDP communication hooks merged at construction.
        handlers: the checked ``kwargs_handlers``; ``plugin_manager``: this Accelerator's own
            ``KwplugPluginManager`` (a ``pluggy.PluginManager``).
        plan: who answered each ``firstresult`` hook (:class:`kwplug.Answer`).

    Raises:
        ValueError: ``mixed_precision`` is not one of ``"no"``, ``"fp16"``, ``"bf16"``; two
            handlers share a class; a torchrun variable is malformed.
        TypeError: ``cpu`` is not a bool; ``kwargs_handlers`` holds something that is not a
            handler instance.
        RuntimeError: ``WORLD_SIZE > 1`` but no plugin initialised the process group.
        kwplug.errors.PluginConflictError: two third-party plugins registered by default
            both claim a one-answer hook for this device (see :mod:`kwplug.hookspecs`).
    """

    def __init__(
        self,
        mixed_precision: Literal["no", "fp16", "bf16"] | str = "no",
        cpu: bool = False,
        kwargs_handlers: Sequence[KwargsHandler] | None = None,
        dataloader_config: DataLoaderConfiguration | None = None,
    ) -> None:
        # Resolved once; the public attributes below are read-only by convention.
        self._setup: _Setup = resolve(mixed_precision, cpu, kwargs_handlers)
        setup = self._setup
        self.mixed_precision: str = setup.mixed_precision
        self.handlers: list[KwargsHandler] = setup.handlers
        self.plugin_manager: KwplugPluginManager = setup.plugins
        #: Which plugin answered each setup hook (``Answer`` records), for debugging.
        self.plan: dict[str, Answer] = setup.plugins.plan
        self.device: torch.device = setup.device
        self.device_type: str = setup.device.type
        self.num_processes: int = setup.process.world_size
        self.process_index: int = setup.process.rank
        self.local_process_index: int = setup.process.local_rank
        self.comm_hooks: dict[str, CommHook] = setup.comm_hooks
        self.scaler: torch.amp.GradScaler | None = setup.scaler
        self._prepared = _Prepared(setup, self.plan, dataloader_config=dataloader_config)
        self.dataloader_config: DataLoaderConfiguration = self._prepared.dataloader_config

    @classmethod
    def from_config(
        cls, source: str | os.PathLike[str] | Mapping[str, Any], **overrides: Any
    ) -> Accelerator:
        """Build an Accelerator from a TOML file or mapping (see :mod:`kwplug.config`).

        Args:
            source: path of a TOML file, or a mapping: top-level ``mixed_precision`` and
                ``cpu``, and one ``[handlers.<entry-point name>]`` table per handler.
            overrides: Accelerator keyword arguments that replace the configured ones.

        Raises:
            kwplug.config.ConfigError: a ``ValueError`` naming the file, table and key.
        """
        from kwplug.config import load_config

        return cls(**{**load_config(source), **overrides})

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on local rank 0 (one process per node)."""
        return self.local_process_index == 0

    @property
    def distributed(self) -> bool:
        """True when more than one process trains (``num_processes > 1``)."""
        return self.num_processes > 1

    # -- prepare (kwplug.accelerator._prepare) -----------------------------------------------

    def prepare(self, *objs: Any) -> Any:
        """Prepare models, optimizers and data loaders for training, in the order given.

        - ``torch.nn.Module``: moved to :attr:`device`, then wrapped through the
          ``wrap_model`` hook (DDP when ``num_processes > 1`` by default).
        - ``torch.optim.Optimizer``: returned as is, or wrapped in a
          :class:`~kwplug.optimizer.ScaledOptimizer` when a gradient scaler is active.
        - ``torch.utils.data.DataLoader``: each rank gets Accelerate's batches
          (:func:`kwplug.data.prepare_dataloader`, ``dataloader_config``), moved to
          :attr:`device`.
        - anything else: returned unchanged.

        Create the optimizer from the model's parameters before or after ``prepare``: DDP
        shares the parameters, and when a wrapper replaces them (FSDP2's ``fully_shard``
        registers ``DTensor`` parameters) every optimizer prepared by this Accelerator, before
        or after the model, is pointed at the new parameters, matched by name.

        Returns:
            The prepared object when one was given, else a tuple in the same order.
        """
        return self._prepared.prepare(objs)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move ``model`` to :attr:`device` and wrap it through the ``wrap_model`` hook.

        Parameters the wrapper replaced are recorded by name; optimizers prepared by this
        Accelerator (already, or later) are pointed at the replacements.
        """
        return self._prepared.model(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Return ``optimizer``, stepping through the gradient scaler when there is one.

        When a prepared model's wrapper replaced parameters, the optimizer's param groups are
        pointed at the replacements first.
        """
        return self._prepared.optimizer(optimizer)

    def prepare_data_loader(
        self, loader: DataLoader[Any], seed: int | None = None
    ) -> DataLoader[Any]:
        """Shard ``loader`` per rank as Accelerate does (:func:`kwplug.data.prepare_dataloader`);
        ``seed`` fixes the shuffle instead of a draw from torch's global generator."""
        return self._prepared.data_loader(loader, seed)

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Return the user's module from inside DDP/DataParallel/``torch.compile`` wrappers."""
        return unwrap_model(model)

    # -- per step ----------------------------------------------------------------------------

    def autocast(self, autocast_handler: KwargsHandler | None = None) -> Any:
        """Return the autocast context manager for this Accelerator's precision.

        ``with accelerator.autocast():`` enters ``torch.autocast(device_type, dtype)`` with the
        dtype of ``mixed_precision`` (``contextlib.nullcontext()`` when it is ``"no"``). The
        factory was resolved once at construction, so this costs what ``torch.autocast`` costs.

        Args:
            autocast_handler: a handler (e.g. ``AutocastKwargs(enabled=False)``) that answers
                the ``autocast`` hook first for this call only; contexts nest as
                ``torch.autocast`` contexts do.

        Raises:
            TypeError: ``autocast_handler`` is not a handler instance.
        """
        if autocast_handler is None:
            return self._setup.autocast_factory()
        factory = self._call_with(
            "autocast",
            autocast_handler,
            device_type=self.device_type,
            mixed_precision=self.mixed_precision,
        )
        return (factory or contextlib.nullcontext)()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)``, through the gradient scaler when there is one."""
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)  # type: ignore[no-untyped-call]
        else:
            loss.backward(**kwargs)  # type: ignore[no-untyped-call]

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` after unscaling the gradients (fp16).

        With a gradient scaler, every prepared optimizer's gradients are unscaled first
        (``GradScaler.unscale_``), so call this at most once per step, between
        :meth:`backward` and ``optimizer.step()``.

        Returns:
            The total gradient norm before clipping (a 0-d tensor).
        """
        if self.scaler is not None:
            for optimizer in self._scaled_optimizers:
                self.scaler.unscale_(optimizer.optimizer)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    # -- distributed helpers (kwplug.accelerator._ops) ----------------------------------------

    def gather(self, tensor: Any) -> Any:
        """Concatenate each tensor of nested ``tensor`` from every rank along dim 0
        (:func:`kwplug.utils.gather`; one process: ``tensor`` itself).

        Raises:
            TypeError: a leaf is not a tensor.
            kwplug.utils.DistributedOperationException: the ranks' shapes differ.
        """
        return _metrics.gather(tensor)

    def reduce(
        self, tensor: Any, reduction: Literal["sum", "mean", "max"] = "sum", scale: float = 1.0
    ) -> Any:
        """All-reduce copies of each tensor of nested ``tensor`` with ``"sum"``, ``"mean"``
        or ``"max"`` (``scale`` is accepted and ignored, as Accelerate ignores it off XLA).

        Raises:
            ValueError: an unknown ``reduction``; the ranks' shapes differ.
            TypeError: a leaf is not a tensor.
        """
        return _metrics.reduce(tensor, reduction)

    def wait_for_everyone(self) -> None:
        """``torch.distributed.barrier()`` when distributed; nothing otherwise."""
        _ops.wait_for_everyone(self.num_processes)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def profile(self, profile_handler: KwargsHandler | None = None) -> Iterator[Any]:
        """Profile the enclosed code; yields the started ``torch.profiler.profile``.

        The profiler comes from the ``make_profiler`` hook, called at each entry
        (``ProfileKwargs.build()`` by default); ``profile_handler`` answers first for this
        call. Call ``prof.step()`` at
        each step when a schedule is set.

        Raises:
            TypeError: ``profile_handler`` is not a handler instance.
            RuntimeError: no plugin built a profiler.
        """
        profiler = self._call_with(
            "make_profiler", profile_handler, device_type=self.device_type, rank=self.process_index
        )
        if profiler is None:
            raise RuntimeError("no plugin answered make_profiler (is ProfileKwargs blocked?)")
        with profiler as prof:
            yield prof

    # -- checkpoints (kwplug.accelerator._checkpointing) --------------------------------------

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include ``objects`` (each with ``state_dict()`` and ``load_state_dict()``, e.g. an
        LR scheduler or a step counter) in :meth:`save_state` / :meth:`load_state`.

        Raises:
            TypeError: an object lacks ``state_dict`` or ``load_state_dict``.
        """
        _checkpointing.register_for_checkpointing(self, *objects)

    def save_state(self, output_dir: str | os.PathLike[str]) -> Path:
        """Save everything needed to resume training exactly, atomically.

        Saves the prepared models (unwrapped ``state_dict``), optimizers, the gradient scaler,
        objects given to :meth:`register_for_checkpointing`, and per rank the RNG states
        (Python, NumPy, torch CPU and device), the prepared data loaders' positions (epoch and
        batches consumed) and the state of stateful DDP communication hooks (PowerSGD's error
        feedback and step counter). Every rank must call it; see :mod:`kwplug.checkpoint` for
        the layout and the crash-safety guarantees.

        A sharded model (``DTensor`` parameters, e.g. from FSDP2's ``fully_shard``) is saved
        as its full state dict, gathered to rank 0 through
        ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` (same keys and
        shapes as the unsharded model's ``state_dict()``); its optimizer as the full
        optimizer state dict (``get_optimizer_state_dict``, keyed by parameter name).

        Args:
            output_dir: the checkpoint directory; an existing checkpoint there is replaced
                only once the new one is complete.

        Returns:
            The checkpoint directory.

        Raises:
            NotImplementedError: an optimizer steps a sharded model's parameters together
                with parameters outside that model.
        """
        return _checkpointing.save_state(self, output_dir)

    def load_state(self, input_dir: str | os.PathLike[str]) -> Path:
        """Restore what :meth:`save_state` saved into the prepared objects, in place.

        Prepare the same models, optimizers and data loaders, in the same order, before
        calling it. Every rank must call it. Sharded models and their optimizers are read on
        rank 0 and broadcast (``set_model_state_dict`` / ``set_optimizer_state_dict`` with
        ``broadcast_from_rank0=True``); each rank keeps its own shards.

        Returns:
            The checkpoint directory read (``DIR.previous`` when a save was interrupted while
            swapping checkpoints).

        Raises:
            FileNotFoundError: no complete checkpoint at ``input_dir``.
            ValueError: the checkpoint was saved with a different number of processes or
                different prepared objects.
            NotImplementedError: (also from :meth:`save_state`) an optimizer steps a sharded
                model's parameters together with parameters outside that model.
        """
        return _checkpointing.load_state(self, input_dir)

    def _collect_handler_state(self) -> dict[str, Any]:
        return _checkpointing._collect_handler_state(self)

    def _restore_handler_state(self, saved: Mapping[str, Any]) -> None:
        _checkpointing._restore_handler_state(self, saved)

    def end_training(self) -> None:
        """Destroy the default process group (``torch.distributed.destroy_process_group``).

        The Accelerator drops its references to prepared objects and runs the garbage
        collector first: a DDP reducer collected after its process group is destroyed can
        abort the process at exit. A script that never calls it is covered too: at interpreter
        exit (``atexit``), a distributed Accelerator's process collects garbage and destroys a
        process group that is still there (without it, gloo aborted about 2 exits in 5).
        """
        self._prepared.clear()
        end_process_group()

    # -- internals: the prepared objects, and hook calls through the setup's plugins ----------

    @property
    def _models(self) -> list[torch.nn.Module]:
        return self._prepared.models

    @property
    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return self._prepared.optimizers

    @property
    def _scaled_optimizers(self) -> list[ScaledOptimizer]:
        return self._prepared.scaled_optimizers

    @property
    def _dataloaders(self) -> list[DataLoader[Any]]:
        return self._prepared.dataloaders

    @property
    def _custom_objects(self) -> list[Any]:
        return self._prepared.custom_objects

    def _call_each(
        self, hook_name: str, *, only: Any = None, **kwargs: Any
    ) -> list[tuple[str, Any]]:
        return self.plugin_manager.call_each(hook_name, only=only, **kwargs)

    def _call_with(self, hook_name: str, handler: KwargsHandler | None, **kwargs: Any) -> Any:
        return self.plugin_manager.call_with(handler, hook_name, **kwargs).result

    def __repr__(self) -> str:
        return (
            f"Accelerator(device={self.device}, mixed_precision={self.mixed_precision!r}, "
            f"num_processes={self.num_processes}, process_index={self.process_index})"
        )

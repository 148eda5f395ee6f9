"""The minimal ``Accelerator``: builds every torch object through the handler hooks."""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from kwplug import checkpoint, discovery
from kwplug.comm_hooks import CommHook, merge_comm_hooks
from kwplug.conflicts import check_conflicts
from kwplug.data import prepare_dataloader
from kwplug.dispatch import Answer, call_each, call_first
from kwplug.environment import ProcessInfo, end_process_group, select_device
from kwplug.handler import KwargsHandler
from kwplug.hookspecs import AutocastFactory
from kwplug.optimizer import ScaledOptimizer
from kwplug.params import ParameterRemap
from kwplug.registry import build_plugin_manager, check_handler, check_handlers, extra_impls

logger = logging.getLogger(__name__)

MIXED_PRECISION = ("no", "fp16", "bf16")


class Accelerator:
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

    Raises:
        ValueError: ``mixed_precision`` is not one of ``"no"``, ``"fp16"``, ``"bf16"``; two
            handlers share a class; a torchrun variable is malformed.
        TypeError: ``kwargs_handlers`` holds something that is not a handler instance.
        RuntimeError: ``WORLD_SIZE > 1`` but no plugin initialised the process group.
        kwplug.conflicts.PluginConflictError: two third-party plugins registered by default
            both claim a one-answer hook for this device (see :mod:`kwplug.conflicts`).
    """

    def __init__(
        self,
        mixed_precision: Literal["no", "fp16", "bf16"] | str = "no",
        cpu: bool = False,
        kwargs_handlers: Sequence[KwargsHandler] | None = None,
    ) -> None:
        if mixed_precision not in MIXED_PRECISION:
            raise ValueError(
                f"mixed_precision must be one of {', '.join(map(repr, MIXED_PRECISION))}, "
                f"got {mixed_precision!r}"
            )
        if not isinstance(cpu, bool):
            raise TypeError(f"cpu must be a bool, got {type(cpu).__name__}")
        self.mixed_precision: str = mixed_precision
        self.handlers = check_handlers(kwargs_handlers)
        self.plugin_manager, self._plugin_descriptions, self._third_party = build_plugin_manager(
            self.handlers, discovery.discover()
        )
        #: Which plugin answered each setup hook (``Answer`` records), for debugging.
        self.plan: dict[str, Answer] = {}

        info = ProcessInfo.current()
        self.device = select_device(cpu, info.local_rank)
        self.device_type: str = self.device.type
        check_conflicts(
            self.plugin_manager, self._third_party.__contains__, self.device_type, self._describe
        )
        self.comm_hooks: dict[str, CommHook] = self._collect_comm_hooks()
        self._call_each(
            "validate_setup",
            device_type=self.device_type,
            world_size=info.world_size,
            mixed_precision=mixed_precision,
            comm_hooks=self.comm_hooks,
        )
        if info.world_size > 1 and not dist.is_initialized():
            done = self._call_first(
                "init_process_group",
                device_type=self.device_type,
                world_size=info.world_size,
                rank=info.rank,
                local_rank=info.local_rank,
            )
            if not done or not dist.is_initialized():
                raise RuntimeError(
                    f"WORLD_SIZE={info.world_size} but no plugin initialised the process group "
                    "(the built-in InitProcessGroupKwargs plugin may be blocked)"
                )
            info = ProcessInfo.current()
        self.num_processes: int = info.world_size
        if self.num_processes > 1:
            _destroy_process_group_at_exit()
        self.process_index: int = info.rank
        self.local_process_index: int = info.local_rank

        self._autocast_factory: AutocastFactory = (
            self._call_first(
                "autocast", device_type=self.device_type, mixed_precision=mixed_precision
            )
            or contextlib.nullcontext
        )
        self.scaler: torch.amp.GradScaler | None = self._call_first(
            "make_scaler", device_type=self.device_type, mixed_precision=mixed_precision
        )
        self._models: list[torch.nn.Module] = []
        self._scaled_optimizers: list[ScaledOptimizer] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._dataloaders: list[DataLoader[Any]] = []
        self._custom_objects: list[Any] = []
        # Parameters that wrappers replaced (FSDP2), so that optimizers follow them.
        self._remap = ParameterRemap()
        logger.debug(
            "Accelerator on %s, rank %d/%d, mixed_precision=%s, plugins: %s",
            self.device,
            self.process_index,
            self.num_processes,
            mixed_precision,
            list(self._plugin_descriptions.values()),
        )

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

    # -- process information ------------------------------------------------------------

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

    # -- setup -----------------------------------------------------------------------------

    def _collect_comm_hooks(self) -> dict[str, CommHook]:
        # Answer by answer, so that a duplicate name can be blamed on the plugin that gave it.
        answers = self._call_each("comm_hooks")
        return merge_comm_hooks([(self._describe(name), answer) for name, answer in answers])

    def prepare(self, *objs: Any) -> Any:
        """Prepare models, optimizers and data loaders for training, in the order given.

        - ``torch.nn.Module``: moved to :attr:`device`, then wrapped through the
          ``wrap_model`` hook (DDP when ``num_processes > 1`` by default).
        - ``torch.optim.Optimizer``: returned as is, or wrapped in a
          :class:`~kwplug.optimizer.ScaledOptimizer` when a gradient scaler is active.
        - ``torch.utils.data.DataLoader``: sharded per rank with ``DistributedSampler``
          semantics, batches moved to :attr:`device`.
        - anything else: returned unchanged.

        Create the optimizer from the model's parameters before or after ``prepare``: DDP
        shares the parameters, and when a wrapper replaces them (FSDP2's ``fully_shard``
        registers ``DTensor`` parameters) every optimizer prepared by this Accelerator, before
        or after the model, is pointed at the new parameters, matched by name.

        Returns:
            The prepared object when one was given, else a tuple in the same order.
        """
        prepared = tuple(self._prepare_one(obj) for obj in objs)
        return prepared[0] if len(prepared) == 1 else prepared

    def _prepare_one(self, obj: Any) -> Any:
        if isinstance(obj, torch.nn.Module):
            return self.prepare_model(obj)
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj)
        if isinstance(obj, DataLoader):
            return self.prepare_data_loader(obj)
        return obj

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move ``model`` to :attr:`device` and wrap it through the ``wrap_model`` hook.

        Parameters the wrapper replaced are recorded by name; optimizers prepared by this
        Accelerator (already, or later) are pointed at the replacements.
        """
        before = dict(model.named_parameters())
        model = model.to(self.device)
        wrapped = self._call_first(
            "wrap_model",
            model=model,
            device=self.device,
            device_type=self.device_type,
            world_size=self.num_processes,
            mixed_precision=self.mixed_precision,
            comm_hooks=self.comm_hooks,
        )
        if wrapped is not None and not isinstance(wrapped, torch.nn.Module):
            plugin = self.plan["wrap_model"].plugin or "?"
            raise TypeError(
                f"hook 'wrap_model' of {self._describe(plugin)} returned "
                f"{type(wrapped).__name__}, not a torch.nn.Module"
            )
        result = wrapped if wrapped is not None else model
        if self._remap.learn(before, dict(self.unwrap_model(result).named_parameters())):
            for optimizer in self._optimizers:
                self._remap.apply(optimizer)
        self._models.append(result)
        return result

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Return ``optimizer``, stepping through the gradient scaler when there is one.

        When a prepared model's wrapper replaced parameters, the optimizer's param groups are
        pointed at the replacements first.
        """
        if self._remap:
            self._remap.apply(optimizer)
        if self.scaler is None or isinstance(optimizer, ScaledOptimizer):
            self._optimizers.append(optimizer)
            return optimizer
        scaled = ScaledOptimizer(optimizer, self.scaler)
        self._scaled_optimizers.append(scaled)
        self._optimizers.append(scaled)
        return scaled

    def prepare_data_loader(self, loader: DataLoader[Any], seed: int = 0) -> DataLoader[Any]:
        """Shard ``loader`` per rank (see :func:`kwplug.data.prepare_dataloader`)."""
        prepared = prepare_dataloader(
            loader, self.device, self.num_processes, self.process_index, seed=seed
        )
        self._dataloaders.append(prepared)
        return prepared

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
            return self._autocast_factory()
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

    # -- distributed helpers ----------------------------------------------------------------

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate ``tensor`` from every rank along dim 0 (0-d tensors become shape
        ``(num_processes,)``). Every rank must pass the same shape. Single process: returns
        ``tensor`` (0-d made 1-d)."""
        if tensor.dim() == 0:
            tensor = tensor.unsqueeze(0)
        if not self.distributed:
            return tensor
        out = [torch.empty_like(tensor) for _ in range(self.num_processes)]
        dist.all_gather(out, tensor.contiguous())
        return torch.cat(out, dim=0)

    def reduce(
        self, tensor: torch.Tensor, reduction: Literal["sum", "mean"] = "sum"
    ) -> torch.Tensor:
        """All-reduce a copy of ``tensor`` across ranks with ``"sum"`` or ``"mean"``.

        Raises:
            ValueError: ``reduction`` is not ``"sum"`` or ``"mean"``.
        """
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        result = tensor.clone()
        if self.distributed:
            dist.all_reduce(result, op=dist.ReduceOp.SUM)
            if reduction == "mean":
                result = result / self.num_processes
        return result

    def wait_for_everyone(self) -> None:
        """``torch.distributed.barrier()`` when distributed; nothing otherwise."""
        if self.distributed:
            dist.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Return the user's module from inside DDP/DataParallel/``torch.compile`` wrappers."""
        while True:
            if isinstance(
                model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
            ):
                model = model.module
            elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
                model = model._orig_mod
            else:
                return model

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

    # -- checkpoints ---------------------------------------------------------------------

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include ``objects`` (each with ``state_dict()`` and ``load_state_dict()``, e.g. an
        LR scheduler or a step counter) in :meth:`save_state` / :meth:`load_state`.

        Raises:
            TypeError: an object lacks ``state_dict`` or ``load_state_dict``.
        """
        checkpoint.register_for_checkpointing(self, *objects)

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
            output_dir: the checkpoint directory: a new version folder is written into it and
                older versions are deleted once it is complete; nothing else there is touched.

        Returns:
            The checkpoint directory.

        Raises:
            kwplug.checkpoint.CheckpointError: another process is saving into
                ``output_dir`` (naming its host and pid); a write failed (disk full: the
                unfinished version is removed, the previous one kept); state that a
                checkpoint cannot hold (only tensors, NumPy arrays and JSON values).
            NotImplementedError: an optimizer steps a sharded model's parameters together
                with parameters outside that model.
        """
        return checkpoint.save_state(self, output_dir)

    def load_state(self, input_dir: str | os.PathLike[str]) -> Path:
        """Restore what :meth:`save_state` saved into the prepared objects, in place.

        Prepare the same models, optimizers and data loaders, in the same order, before
        calling it. Every rank must call it. Sharded models and their optimizers are read on
        rank 0 and broadcast (``set_model_state_dict`` / ``set_optimizer_state_dict`` with
        ``broadcast_from_rank0=True``); each rank keeps its own shards.

        Every file is verified (manifest, size, sha256, kind, shapes) before any object is
        loaded; no file is unpickled.

        Returns:
            The version folder read (the newest complete one in ``input_dir``).

        Raises:
            FileNotFoundError: no complete checkpoint at ``input_dir``.
            kwplug.checkpoint.CheckpointError: (a ``ValueError``) a file is missing,
                truncated, altered, not regular or not listed; the checkpoint was saved with a
                different number of processes or different prepared objects (class, shapes).
            NotImplementedError: (also from :meth:`save_state`) an optimizer steps a sharded
                model's parameters together with parameters outside that model.
        """
        return checkpoint.load_state(self, input_dir)

    def end_training(self) -> None:
        """Destroy the default process group (``torch.distributed.destroy_process_group``).

        The Accelerator drops its references to prepared objects and runs the garbage
        collector first: a DDP reducer collected after its process group is destroyed can
        abort the process at exit. A script that never calls it is covered too: at interpreter
        exit (``atexit``), a distributed Accelerator's process collects garbage and destroys a
        process group that is still there (without it, gloo aborted about 2 exits in 5).
        """
        self._models.clear()
        self._optimizers.clear()
        self._scaled_optimizers.clear()
        self._dataloaders.clear()
        self._custom_objects.clear()
        end_process_group()

    # -- internals ---------------------------------------------------------------------------

    def _describe(self, name: str) -> str:
        return self._plugin_descriptions.get(name, name)

    def _call_first(
        self, hook_name: str, *, extra: Sequence[Any] = (), record: bool = True, **kwargs: Any
    ) -> Any:
        answer = call_first(
            self.plugin_manager,
            hook_name,
            kwargs,
            extra=extra,
            describe=self._describe,
            third_party=self._third_party.__contains__,
        )
        if record:  # per-call handlers do not replace the set-up answers
            self.plan[hook_name] = answer
        logger.debug(
            "hook %s answered by %s", hook_name, self._describe(answer.plugin or "no plugin")
        )
        return answer.result

    def _call_each(
        self, hook_name: str, *, only: Any = lambda name: True, **kwargs: Any
    ) -> list[tuple[str, Any]]:
        return call_each(
            self.plugin_manager,
            hook_name,
            kwargs,
            describe=self._describe,
            third_party=self._third_party.__contains__,
            only=only,
        )

    def _call_with(self, hook_name: str, handler: KwargsHandler | None, **kwargs: Any) -> Any:
        if handler is None:
            return self._call_first(hook_name, **kwargs)
        check_handler(handler, f"the {hook_name} handler")
        extra = extra_impls(self.plugin_manager, handler, hook_name)
        return self._call_first(hook_name, extra=extra, record=False, **kwargs)

    def __repr__(self) -> str:
        return (
            f"Accelerator(device={self.device}, mixed_precision={self.mixed_precision!r}, "
            f"num_processes={self.num_processes}, process_index={self.process_index})"
        )


@functools.cache
def _destroy_process_group_at_exit() -> None:
    # Once per process. atexit runs before interpreter teardown frees gloo's objects in an
    # arbitrary order; a no-op when end_training() already destroyed the group.
    atexit.register(end_process_group)

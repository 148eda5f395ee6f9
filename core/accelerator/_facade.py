"""The public ``Accelerator``: each method delegates to the setup resolved at construction
(:mod:`._setup`), the prepared-object registry (:mod:`._prepare`), the collectives
(:mod:`._ops`) or checkpointing (:mod:`kwplug.checkpoint`)."""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import torch

from kwplug._plugins import Answer, KwplugPluginManager
from kwplug._process.environment import end_process_group
from kwplug._runtime import register_accelerator
from kwplug.accelerator import _metrics, _ops
from kwplug.accelerator._agreement import LiveAgreement, check_ranks_agree
from kwplug.accelerator._api_prepare import _PrepareAPI
from kwplug.accelerator._api_process import _DataAndProcessAPI
from kwplug.accelerator._api_saving import _SavingAPI
from kwplug.accelerator._api_tracking import _TrackingAPI
from kwplug.accelerator._api_training import _TrainingAPI
from kwplug.accelerator._compile_keywords import with_compile_handler
from kwplug.accelerator._gradient_state import GradientState
from kwplug.accelerator._keywords import check_bool
from kwplug.accelerator._launched import launched_handlers
from kwplug.accelerator._options import mixed_precision_from_env, resolve_options
from kwplug.accelerator._prepare import _Prepared
from kwplug.accelerator._setup import _Setup, resolve
from kwplug.accelerator._tracking import LogWith, _Trackers
from kwplug.comm_hooks import CommHook
from kwplug.handler import KwargsHandler
from kwplug.precision import LossScaler
from kwplug.utils.dataclasses import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from kwplug.validators import cut_error

#: What ``autocast()`` returns without mixed precision: ``contextlib.nullcontext`` holds no
#: state, so one instance can be entered by any number of calls, nested or in threads.
_NO_AUTOCAST = contextlib.nullcontext()


class Accelerator(_PrepareAPI, _TrainingAPI, _TrackingAPI, _SavingAPI, _DataAndProcessAPI):
    """Runs a training loop on the device and processes chosen by torchrun, through plugins.

    Every torch object it builds -- the process group, the autocast context, the gradient
    scaler, the model wrapper (DDP) and the profiler -- comes from a hook call
    (:mod:`kwplug.hookspecs`), answered first by the handlers in ``kwargs_handlers``, then by
    third-party plugins, then by kwplug's built-ins. Hooks are called here and in
    :meth:`prepare`; per training step only ``no_sync``, inside :meth:`accumulate`.

    Args:
        mixed_precision: ``"no"``: full precision; ``"fp16"`` (``torch.autocast`` to float16
            and a ``torch.amp.GradScaler``) or ``"bf16"`` (autocast to bfloat16, no scaler).
            Works on CPU too. Default ``None``: ``ACCELERATE_MIXED_PRECISION`` (what
            ``kwplug launch --mixed_precision`` and ``accelerate launch`` set), else ``"no"``.
        cpu: train on the CPU even when an accelerator is available (also when
            ``ACCELERATE_USE_CPU`` is true: ``kwplug launch --cpu``).
        kwargs_handlers: handler instances (``AutocastKwargs``, ``DistributedDataParallelKwargs``,
            ``GradScalerKwargs``, ``InitProcessGroupKwargs``, ``ProfileKwargs``, a subclass of
            one, or a third-party handler), at most one per class.
        gradient_accumulation_steps: ``int`` >= 1, default 1; micro-batches per optimizer
            step in :meth:`accumulate`. ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS`` (``kwplug
            launch --gradient_accumulation_steps``) replaces it, as in Accelerate (a warning
            when it overrides a value other than 1).
        gradient_accumulation_plugin: a ``kwplug.utils.GradientAccumulationPlugin`` instead.
        dataloader_config: how :meth:`prepare` shards data loaders
            (:class:`~kwplug.utils.DataLoaderConfiguration`; default: its defaults).
        step_scheduler_with_optimizer: default ``True``; prepared schedulers step only when
            the optimizers do (see :class:`kwplug.scheduler.AcceleratedScheduler`).
        split_batches: legacy; a ``dataloader_config`` field.
        even_batches: legacy; a ``dataloader_config`` field.
        log_with: trackers for :meth:`log`: a name a plugin contributes (built in:
            ``"tensorboard"``, ``"jsonl"``), ``"all"`` (every available one), a
            :class:`kwplug.tracking.GeneralTracker` instance, or a list of those; default none.
        project_dir: folder for checkpoints and (unless ``project_config`` sets
            ``logging_dir``) trackers' logs; overrides ``project_config.project_dir``.
        project_config: a :class:`kwplug.utils.ProjectConfiguration` (default: a new one).
        device_placement: default ``True``: :meth:`prepare` moves models, optimizer state and
            batches to :attr:`device`; ``False``: nothing is moved unless a ``prepare*``
            call's ``device_placement`` says so (as Accelerate).
        dynamo_backend: ``torch.compile`` backend for every prepared model (``"eager"``,
            ``"inductor"``..., any case; default ``None``: ``ACCELERATE_DYNAMO_BACKEND`` or
            ``"no"``): ``TorchDynamoPlugin(backend=dynamo_backend)``, the built-in ``dynamo``
            plugin answering the ``compile_model`` hook.
        dynamo_plugin: a :class:`kwplug.utils.TorchDynamoPlugin` instead (not with
            ``dynamo_backend``: ``ValueError``).
        fsdp_plugin: Accelerate's keyword for the FSDP2 handler
            (``kwplug.FullyShardedDataParallelPlugin``, the built-in ``fsdp`` plugin); it is
            one more kwargs handler, answering before ``kwargs_handlers``. Default ``None``:
            the plugin's ``from_launcher()``, a plugin built from the ``FSDP_*`` variables
            when ``ACCELERATE_USE_FSDP`` is ``"true"`` (``accelerate``/``kwplug launch
            --use_fsdp``, a config file's ``distributed_type: FSDP``), as Accelerate.
        parallelism_config: Accelerate's keyword for the device-mesh handler
            (``kwplug.ParallelismConfig``, the built-in ``parallelism`` plugin); answers before
            ``fsdp_plugin``. Its mesh is :attr:`torch_device_mesh`. Default ``None``: built
            from the ``PARALLELISM_CONFIG_*`` variables when
            ``ACCELERATE_USE_PARALLELISM_CONFIG`` is ``"true"``, as Accelerate.

    The rest of the methods come from the base classes, one concern each: ``_PrepareAPI``
    (``prepare``, ``prepare_model``, ``prepare_optimizer``, ``prepare_data_loader``,
    ``prepare_scheduler``), ``_TrainingAPI`` (``accumulate``, ``no_sync``, ``backward``,
    clipping, ``join_uneven_inputs``), ``_TrackingAPI`` (``init_trackers``, ``log``,
    ``logging_dir``), ``_SavingAPI`` (``save_model``, ``save_state``, ``load_state``,
    ``project_dir``) and ``_DataAndProcessAPI`` (data-loader, metrics and process-control
    methods: ``gather_for_metrics``, ``main_process_first``, ``on_main_process``, ``state``...).

    Attributes:
        device: the ``torch.device`` this process trains on (``device_type``: its type).
        num_processes: ``WORLD_SIZE``; ``process_index`` / ``local_process_index``: the
            global / node-local rank.
        scaler: the ``make_scaler`` answer, a :class:`kwplug.precision.LossScaler`
            (``torch.amp.GradScaler`` under fp16 with the built-in handler), or ``None``.
        comm_hooks: the named DDP communication hooks merged at construction.
        handlers: the checked ``kwargs_handlers``; ``plugin_manager``: this Accelerator's own
            ``KwplugPluginManager`` (a ``pluggy.PluginManager``).
        plan: who answered each ``firstresult`` hook (:class:`kwplug.Answer`).
        gradient_state: where gradient accumulation is (``GradientState``); the keywords are
            kept as ``dataloader_config``, ``project_configuration``, ``log_with``,
            ``step_scheduler_with_optimizer``.

    Raises:
        ValueError: ``mixed_precision`` is not one of ``"no"``, ``"fp16"``, ``"bf16"``; two
            handlers share a class; a torchrun variable is malformed;
            ``gradient_accumulation_steps < 1`` or given with ``gradient_accumulation_plugin``.
        TypeError: ``cpu`` is not a bool; ``kwargs_handlers`` holds something that is not a
            handler instance; another keyword has the wrong type (the message names it);
            ``log_with`` holds something else than names and trackers.
        ValueError: (also) an unknown tracker name (lists the available ones), or a tracker
            writing files while no ``project_dir``/``logging_dir`` is set.
        RuntimeError: ``WORLD_SIZE > 1`` but no plugin initialised the process group; or
            the other ranks did not construct an Accelerator within the process group's
            timeout.
        kwplug.errors.PluginConflictError: two third-party plugins registered by default
            both claim a one-answer hook for this device (see :mod:`kwplug.hookspecs`).
        kwplug.errors.RankMismatchError: (``WORLD_SIZE > 1``, on every rank) the ranks were
            built with different settings, versions or plugins; the message names each
            field and each rank's value (one ``all_gather_object`` of a digest, see
            :mod:`kwplug.accelerator._agreement`).
        kwplug.errors.MissingFeatureError: ``mixed_precision="fp16"``/``"bf16"`` or
            ``WORLD_SIZE > 1`` asks for autocast, a gradient scaler or DDP wrapping and no
            plugin provides it (blocked, disabled, failed to load); the message says why for
            each possible provider.
    """

    def __init__(
        self,
        mixed_precision: Literal["no", "fp16", "bf16"] | str | None = None,
        cpu: bool = False,
        kwargs_handlers: Sequence[KwargsHandler] | None = None,
        *,
        gradient_accumulation_steps: int = 1,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        dataloader_config: DataLoaderConfiguration | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: ProjectConfiguration | None = None,
        log_with: LogWith = None,
        step_scheduler_with_optimizer: bool = True,
        split_batches: bool | None = None,
        even_batches: bool | None = None,
        device_placement: bool = True,
        dynamo_backend: str | None = None,
        dynamo_plugin: KwargsHandler | None = None,
        fsdp_plugin: KwargsHandler | None = None,
        parallelism_config: KwargsHandler | None = None,
    ) -> None:
        try:
            options = resolve_options(
                gradient_accumulation_steps, gradient_accumulation_plugin, dataloader_config,
                project_dir, project_config, log_with, step_scheduler_with_optimizer,
                split_batches, even_batches,
            )  # fmt: skip
        except (TypeError, ValueError) as exc:  # a message never echoes a 20 MB argument
            given = (gradient_accumulation_steps, project_dir, log_with, split_batches)
            short = cut_error(exc, (*given, even_batches, step_scheduler_with_optimizer))
            if short is None:
                raise
            raise short from None
        # torch.compile is the `dynamo` plugin's: the keywords only add its handler.
        kwargs_handlers = with_compile_handler(kwargs_handlers, dynamo_backend, dynamo_plugin)
        # Accelerate's plugin keywords are handlers like any other; the mesh's comes first so
        # that tensor parallelism is applied before the data-parallel wrapper.
        # A keyword left None takes what `accelerate launch`'s variables ask for (the plugin's
        # `from_launcher`), as Accelerate's Accelerator builds its plugins from them.
        keywords = launched_handlers(
            {"parallelism_config": parallelism_config, "fsdp_plugin": fsdp_plugin},
            kwargs_handlers,
        )
        # (Both None for nearly every Accelerator: no call, no checks.)
        plugin_keywords = keywords["parallelism_config"], keywords["fsdp_plugin"]
        extra = _plugin_keywords(**keywords) if plugin_keywords != (None, None) else []
        handlers = [*extra, *(kwargs_handlers or ())] if extra else kwargs_handlers
        # Resolved once; the public attributes below are read-only by convention.
        self._setup: _Setup = resolve(mixed_precision_from_env(mixed_precision), cpu, handlers)
        self.parallelism_config: KwargsHandler | None = keywords["parallelism_config"]
        # What Accelerate keeps as ``state.fsdp_plugin`` (the keyword's or the launcher's).
        self._fsdp_plugin: KwargsHandler | None = keywords["fsdp_plugin"]
        #: The ``device_mesh`` hook's ``torch.distributed.device_mesh.DeviceMesh``, or ``None``.
        self.torch_device_mesh: Any = self._setup.device_mesh
        setup = self._setup
        check_ranks_agree(setup, options)  # one small all-gather when distributed
        # ... and again at prepare, the first backward, save_state and load_state.
        self._agreement = LiveAgreement(setup, options, weakref.ref(self))
        self.mixed_precision: str = setup.mixed_precision
        self.device_placement: bool = check_bool("device_placement", device_placement)
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
        self.scaler: LossScaler | None = setup.scaler
        self.project_configuration: ProjectConfiguration = options.project_configuration
        self.log_with: list[Any] = options.log_with
        self.step_scheduler_with_optimizer: bool = options.step_scheduler_with_optimizer
        self.gradient_state = GradientState.from_plugin(options.gradient_accumulation)
        self._prepared = _Prepared(
            setup,
            self.plan,
            gradient_state=self.gradient_state,
            options=options,
            dataloader_config=options.dataloader_config,
        )
        self._trackers = _Trackers.resolve(
            setup.plugins, self.log_with, self.logging_dir, self.is_main_process
        )
        # What kwplug.state.AcceleratorState() reports while this Accelerator lives (weakly).
        register_accelerator(self)

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
    def distributed(self) -> bool:
        """True when more than one process trains (``num_processes > 1``; kwplug's name of
        ``use_distributed``)."""
        return self.use_distributed

    # -- prepare, prepare_model, prepare_optimizer, prepare_data_loader: ._api_prepare ------

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
            own = self._setup.autocast_factory
            # One stateless nullcontext serves every call: no object and no __init__ frame
            # per step (what the full-precision step would otherwise pay here).
            return _NO_AUTOCAST if own is contextlib.nullcontext else own()
        factory = self.plugin_manager.first_with(autocast_handler).autocast(
            device_type=self.device_type, mixed_precision=self.mixed_precision
        )
        return (factory or contextlib.nullcontext)()

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
        """``torch.distributed.barrier()`` when distributed; nothing otherwise. A rank that
        does not arrive within ``KWPLUG_RANK_WAIT`` seconds (default: the process group's
        timeout) is named by a :class:`kwplug.errors.RankTimeoutError` on the others."""
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
        profiler = self.plugin_manager.first_with(profile_handler).make_profiler(
            device_type=self.device_type, rank=self.process_index
        )
        if profiler is None:
            raise RuntimeError("no plugin answered make_profiler (is ProfileKwargs blocked?)")
        with profiler as prof:
            yield prof

    def end_training(self) -> None:
        """Finish the trackers (main process), then destroy the default process group
        (``torch.distributed.destroy_process_group``).

        The Accelerator drops its references to prepared objects and, when a process group
        exists, runs the garbage collector before destroying it: a DDP reducer collected after
        its process group is destroyed can abort the process at exit. Without a group nothing
        is collected (a full ``gc.collect()`` costs 100-300 ms). A script that never calls it
        is covered too: at interpreter exit (``atexit``), a distributed Accelerator's process
        collects garbage and destroys a process group that is still there (without it, gloo
        aborted about 2 exits in 5).
        """
        self._trackers.finish()
        self._prepared.clear()
        end_process_group()

    # -- accumulate, no_sync, sync_gradients, backward, clip_grad_norm_...: ._api_training;
    # trackers: ._api_tracking; save_model, save_state, project_dir...: ._api_saving.

    def __repr__(self) -> str:
        return (
            f"Accelerator(device={self.device}, mixed_precision={self.mixed_precision!r}, "
            f"num_processes={self.num_processes}, process_index={self.process_index})"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        # An Accelerator holds this process's plugin manager, process group and hooks into
        # prepared objects: none of that means anything in another process, so say so here
        # instead of pickle's "cannot pickle 'module' object" from deep inside.
        raise TypeError(
            "an Accelerator cannot be pickled (it holds this process's plugins, process group "
            "and prepared objects); pickle what you need instead: accelerator.state's fields, "
            "a prepared object's state_dict(), or a checkpoint from save_state()"
        )


def _plugin_keywords(**given: KwargsHandler | None) -> list[KwargsHandler]:
    """The handlers given by Accelerate's plugin keywords, in order.

    Raises:
        TypeError: one is not a kwplug handler instance (e.g. Accelerate's own plugin).
    """
    for keyword, handler in given.items():
        if handler is not None and not isinstance(handler, KwargsHandler):
            raise TypeError(
                f"{keyword} must be a kwplug handler instance (kwplug exports one under "
                f"Accelerate's class name), got {type(handler).__module__}."
                f"{type(handler).__qualname__}"
            )
    return [h for h in given.values() if h is not None]

"""``Accelerator.prepare``: models, optimizers and data loaders, and the registry of what was
prepared (which checkpoints, gradient clipping and ``end_training`` read)."""

from __future__ import annotations

from typing import Any, TypeVar

import attrs
import torch
from torch.utils.data import DataLoader

from kwplug._plugins import Answer
from kwplug._runtime import apply_mixed_precision
from kwplug.accelerator._device_map import stays_where_mapped
from kwplug.accelerator._gradient_state import GradientState
from kwplug.accelerator._options import _Options
from kwplug.accelerator._params import ParameterRemap
from kwplug.accelerator._setup import _Setup
from kwplug.data import ActiveLoaders, PreparedDataLoader, prepare_dataloader
from kwplug.errors import PluginHookError
from kwplug.optimizer import AcceleratedOptimizer, ScalerUpdates
from kwplug.scheduler import AcceleratedScheduler
from kwplug.utils.dataclasses import DataLoaderConfiguration


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module from inside DDP/DataParallel/``torch.compile`` wrappers."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def _default_config(value: Any) -> Any:
    return DataLoaderConfiguration() if value is None else value


def _require_synchronised(setup: _Setup, model: torch.nn.Module) -> None:
    # Without a wrapper nothing all-reduces the gradients: every rank would train its own
    # model and the run would end "successfully" with diverged weights.
    world_size = setup.process.world_size
    if world_size <= 1 or not any(p.requires_grad for p in model.parameters()):
        return
    implementers = [
        setup.plugins.describe(i.plugin_name) for i in setup.plugins.hook_impls("wrap_model")
    ]
    raise PluginHookError(
        f"{world_size} processes are running but no plugin wrapped the model "
        f"{type(model).__qualname__} (hook 'wrap_model' answered None; implemented by: "
        f"{', '.join(implementers) or 'no loaded plugin'}), so its gradients would never be "
        "synchronised and each rank would train its own copy. Load the built-in 'ddp' plugin "
        "(check KWPLUG_BLOCK_PLUGINS, KWPLUG_PLUGINS; `kwplug plugins` lists them) or pass a "
        "handler that implements wrap_model",
        hook="wrap_model",
    )


@attrs.define(eq=False)
class _Prepared:
    """Prepares objects for one Accelerator and keeps every prepared object, in order.

    Attributes:
        setup: the Accelerator's resolved setup (device, ranks, plugins, scaler).
        plan: the Accelerator's record of who answered each hook (``wrap_model`` is added).
        models: prepared (wrapped) models.
        optimizers: prepared optimizers (each an ``AcceleratedOptimizer``).
        scaled_optimizers: those stepping through the gradient scaler (fp16).
        dataloaders: prepared data loaders.
        schedulers: prepared schedulers (``AcceleratedScheduler``).
        custom_objects: objects registered for checkpointing (prepared schedulers too).
        remap: parameters that wrappers replaced (FSDP2), so that optimizers follow them.
        gradient_state: where gradient accumulation is; read by prepared optimizers,
            schedulers and data loaders.
        options: the Accelerator's keywords (how prepared schedulers step); ``None``:
            Accelerate's defaults.
        dataloader_config: how data loaders are sharded (``None``: the defaults).
        active_loaders: the prepared loaders being iterated (end of data loader, remainder);
            the gradient state's.
    """

    setup: _Setup
    plan: dict[str, Answer]
    models: list[torch.nn.Module] = attrs.Factory(list)
    optimizers: list[AcceleratedOptimizer] = attrs.Factory(list)
    scaled_optimizers: list[AcceleratedOptimizer] = attrs.Factory(list)
    dataloaders: list[DataLoader[Any]] = attrs.Factory(list)
    schedulers: list[AcceleratedScheduler] = attrs.Factory(list)
    custom_objects: list[Any] = attrs.Factory(list)
    remap: ParameterRemap = attrs.Factory(ParameterRemap)
    gradient_state: GradientState = attrs.Factory(GradientState)
    options: _Options | None = None
    scaler_updates: ScalerUpdates | None = attrs.field(init=False)

    @property
    def active_loaders(self) -> ActiveLoaders:
        """The prepared loaders being iterated (shared with the gradient state)."""
        return self.gradient_state.loaders

    def __attrs_post_init__(self) -> None:
        backend = self.setup.scaler
        # Past attrs' on_setattr hooks (the field has no converter or validator to run): four
        # Python calls fewer for every Accelerator.
        object.__setattr__(
            self, "scaler_updates", None if backend is None else ScalerUpdates(backend)
        )

    dataloader_config: DataLoaderConfiguration = attrs.field(
        default=None,
        converter=_default_config,
        validator=attrs.validators.instance_of(DataLoaderConfiguration),
    )

    def prepare(self, objs: tuple[Any, ...], placements: list[bool] | None = None) -> Any:
        """Each of ``objs`` prepared by type; one object, or a tuple in the same order.
        Schedulers are prepared last, so that they find their prepared optimizer.
        ``placements``: per object, whether it goes to the device (default: all)."""
        places = [True] * len(objs) if placements is None else placements
        prepared = [
            None if _is_scheduler(obj) else self._prepare_one(obj, place)
            for obj, place in zip(objs, places, strict=True)
        ]
        prepared = [
            self.scheduler(o) if _is_scheduler(o) else p
            for o, p in zip(objs, prepared, strict=True)
        ]
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _prepare_one(self, obj: Any, place: bool) -> Any:
        if isinstance(obj, torch.nn.Module):
            return self.model(obj, place)
        if isinstance(obj, torch.optim.Optimizer):
            return self.optimizer(obj, place)
        if isinstance(obj, DataLoader):
            return self.data_loader(obj, device_placement=place)
        return obj

    def model(
        self, model: torch.nn.Module, device_placement: bool = True, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Move ``model`` to the device (unless not ``device_placement``); with mixed
        precision, run its ``forward`` under the autocast context with float32 outputs
        (``kwplug._runtime._forward``, as Accelerate's ``prepare``); wrap it through
        ``wrap_model`` (unless ``evaluation_mode``: Accelerate's, no DDP wrapper for a model
        only evaluated); follow replaced parameters in every prepared optimizer; then, last,
        ``compile_model`` (``torch.compile`` with ``dynamo_backend=``/``TorchDynamoPlugin``).

        A model loaded with a device map (``hf_device_map``) stays where the map put it,
        after Accelerate's checks (:mod:`kwplug.accelerator._device_map`).

        Raises:
            ValueError: a device-mapped model Accelerate refuses to train (spread over devices
                in a multi-process run; 8-bit/4-bit with CPU or disk offload...).
            TypeError: the answering plugin (``wrap_model``, ``compile_model``) returned
                something that is not a module.
            PluginHookError: several processes run and no plugin wrapped a model that has
                trainable parameters (its gradients would never be synchronised).
        """
        if any(model is m for m in self.models):  # prepared here already: not wrapped twice
            return model
        setup = self.setup
        before = dict(model.named_parameters())
        mapped = stays_where_mapped(model, setup.device, setup.process.world_size)
        if device_placement and not mapped:  # a device-mapped model stays, as Accelerate's
            model = model.to(setup.device)
        if setup.mixed_precision != "no":
            # Patched before wrapping, as Accelerate: a DDP wrapper calls the patched forward.
            apply_mixed_precision(model, setup.autocast_factory)
        if evaluation_mode:
            model = _mark(self._compiled(model))
            self.models.append(model)
            return model
        wrapped = setup.plugins.first.wrap_model(
            model=model,
            device=setup.device,
            device_type=setup.device.type,
            world_size=setup.process.world_size,
            mixed_precision=setup.mixed_precision,
            comm_hooks=setup.comm_hooks,
            device_mesh=setup.device_mesh,
        )
        if wrapped is not None and not isinstance(wrapped, torch.nn.Module):
            plugin = self.plan["wrap_model"].plugin or "?"
            raise TypeError(
                f"hook 'wrap_model' of {setup.plugins.describe(plugin)} returned "
                f"{type(wrapped).__name__}, not a torch.nn.Module"
            )
        if wrapped is None:
            _require_synchronised(setup, model)
        result = wrapped if wrapped is not None else model
        if self.remap.learn(before, dict(unwrap_model(result).named_parameters())):
            for optimizer in self.optimizers:
                self.remap.apply(optimizer)
        result = _mark(self._compiled(result))
        self.models.append(result)
        return result

    def _compiled(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` through the ``compile_model`` hook, last, as Accelerate compiles last
        (also in ``evaluation_mode``); itself when no plugin answers."""
        compiled = self.setup.plugins.first.compile_model(model=model)
        if compiled is None:
            return model
        if not isinstance(compiled, torch.nn.Module):
            plugin = self.plan["compile_model"].plugin or "?"
            raise TypeError(
                f"hook 'compile_model' of {self.setup.plugins.describe(plugin)} returned "
                f"{type(compiled).__name__}, not a torch.nn.Module"
            )
        return compiled

    def optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool = True
    ) -> AcceleratedOptimizer:
        """Point ``optimizer`` at replaced parameters; wrap it in an ``AcceleratedOptimizer``
        (stepping through the scaler when one is active; its existing state moved to the
        device with ``device_placement``)."""
        if self.remap:
            self.remap.apply(optimizer)
        if isinstance(optimizer, AcceleratedOptimizer):  # prepared already (a retry loop)
            if optimizer not in self.optimizers:
                self.optimizers.append(optimizer)
            return optimizer
        scaler = self.setup.scaler
        wrapped = AcceleratedOptimizer(
            optimizer,
            device_placement,
            scaler,
            self.gradient_state,
            self.scaler_updates,
            device=self.setup.device,
        )
        if scaler is not None:
            self.scaled_optimizers.append(wrapped)
        self.optimizers.append(_mark(wrapped))
        return wrapped

    def scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap ``scheduler`` in an ``AcceleratedScheduler`` following the prepared optimizer
        it schedules (every prepared optimizer when none matches) and register it for
        checkpointing."""
        if isinstance(scheduler, AcceleratedScheduler):  # prepared already
            if scheduler not in self.schedulers:
                self.schedulers.append(scheduler)
            return scheduler
        options = self.options
        target = getattr(scheduler, "optimizer", None)
        mine = [o for o in self.optimizers if target is o or target is o.optimizer]
        wrapped = AcceleratedScheduler(
            scheduler,
            mine or self.optimizers,
            self.gradient_state,
            num_processes=self.setup.process.world_size,
            step_with_optimizer=options.step_scheduler_with_optimizer if options else True,
            split_batches=self.dataloader_config.split_batches,
        )
        self.schedulers.append(_mark(wrapped))
        self.custom_objects.append(wrapped)
        return wrapped

    def data_loader(
        self, loader: DataLoader[Any], seed: int | None = None, device_placement: bool = True
    ) -> PreparedDataLoader:
        """Shard ``loader`` for this rank (:func:`kwplug.data.prepare_dataloader`); its batches
        are moved to the device only with ``device_placement``."""
        size, rank = self.setup.data_parallel  # the data-parallel ranks only (device mesh)
        prepared = prepare_dataloader(
            loader,
            self.setup.device,
            size,
            rank,
            seed=seed,
            config=self.dataloader_config,
            tracker=self.active_loaders,
        )
        prepared.device_placement = device_placement
        prepared.gradient_state = self.gradient_state  # Accelerate's loader attribute
        _mark(prepared)
        if prepared not in self.dataloaders:
            self.dataloaders.append(prepared)
        return prepared

    def clear(self) -> None:
        """Drop every reference to prepared and registered objects."""
        self.models.clear()
        self.optimizers.clear()
        self.scaled_optimizers.clear()
        self.dataloaders.clear()
        self.schedulers.clear()
        self.custom_objects.clear()
        if self.scaler_updates is not None:
            self.scaler_updates = ScalerUpdates(self.scaler_updates.backend)


_T = TypeVar("_T")


def _mark(obj: _T) -> _T:
    """``obj`` with Accelerate's flag of a prepared object, ``_is_accelerate_prepared = True``
    (code written for Accelerate reads it to tell prepared objects apart)."""
    setattr(obj, "_is_accelerate_prepared", True)  # noqa: B010  (Accelerate's private name)
    return obj


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, AcceleratedScheduler))

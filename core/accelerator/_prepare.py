"""``Accelerator.prepare``: models, optimizers and data loaders, and the registry of what was
prepared (which checkpoints, gradient clipping and ``end_training`` read)."""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch.utils.data import DataLoader

from kwplug._plugins import Answer
from kwplug.accelerator._setup import _Setup
from kwplug.data import prepare_dataloader
from kwplug.errors import PluginHookError
from kwplug.optimizer import ScaledOptimizer
from kwplug.params import ParameterRemap


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module from inside DDP/DataParallel/``torch.compile`` wrappers."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


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
        optimizers: prepared optimizers (``ScaledOptimizer`` when a scaler is active).
        scaled_optimizers: the ``ScaledOptimizer`` among them.
        dataloaders: prepared data loaders.
        custom_objects: objects registered for checkpointing.
        remap: parameters that wrappers replaced (FSDP2), so that optimizers follow them.
    """

    setup: _Setup
    plan: dict[str, Answer]
    models: list[torch.nn.Module] = attrs.Factory(list)
    optimizers: list[torch.optim.Optimizer] = attrs.Factory(list)
    scaled_optimizers: list[ScaledOptimizer] = attrs.Factory(list)
    dataloaders: list[DataLoader[Any]] = attrs.Factory(list)
    custom_objects: list[Any] = attrs.Factory(list)
    remap: ParameterRemap = attrs.Factory(ParameterRemap)

    def prepare(self, objs: tuple[Any, ...]) -> Any:
        """Each of ``objs`` prepared by type; one object, or a tuple in the same order."""
        prepared = tuple(self._prepare_one(obj) for obj in objs)
        return prepared[0] if len(prepared) == 1 else prepared

    def _prepare_one(self, obj: Any) -> Any:
        if isinstance(obj, torch.nn.Module):
            return self.model(obj)
        if isinstance(obj, torch.optim.Optimizer):
            return self.optimizer(obj)
        if isinstance(obj, DataLoader):
            return self.data_loader(obj)
        return obj

    def model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move ``model`` to the device, wrap it through ``wrap_model``, follow replaced
        parameters in every prepared optimizer.

        Raises:
            TypeError: the answering plugin returned something that is not a module.
            PluginHookError: several processes run and no plugin wrapped a model that has
                trainable parameters (its gradients would never be synchronised).
        """
        setup = self.setup
        before = dict(model.named_parameters())
        model = model.to(setup.device)
        wrapped = setup.plugins.call_first(
            "wrap_model",
            model=model,
            device=setup.device,
            device_type=setup.device.type,
            world_size=setup.process.world_size,
            mixed_precision=setup.mixed_precision,
            comm_hooks=setup.comm_hooks,
        ).result
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
        self.models.append(result)
        return result

    def optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point ``optimizer`` at replaced parameters; wrap it when a scaler is active."""
        if self.remap:
            self.remap.apply(optimizer)
        scaler = self.setup.scaler
        if scaler is None or isinstance(optimizer, ScaledOptimizer):
            self.optimizers.append(optimizer)
            return optimizer
        scaled = ScaledOptimizer(optimizer, scaler)
        self.scaled_optimizers.append(scaled)
        self.optimizers.append(scaled)
        return scaled

    def data_loader(self, loader: DataLoader[Any], seed: int = 0) -> DataLoader[Any]:
        """Shard ``loader`` for this rank (:func:`kwplug.data.prepare_dataloader`)."""
        process = self.setup.process
        prepared = prepare_dataloader(
            loader, self.setup.device, process.world_size, process.rank, seed=seed
        )
        self.dataloaders.append(prepared)
        return prepared

    def clear(self) -> None:
        """Drop every reference to prepared and registered objects."""
        self.models.clear()
        self.optimizers.clear()
        self.scaled_optimizers.clear()
        self.dataloaders.clear()
        self.custom_objects.clear()

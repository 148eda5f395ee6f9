"""The Accelerator's saving methods (a base class of ``Accelerator``): model files through
:mod:`._saving`, checkpoints through :mod:`kwplug.checkpoint`."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from kwplug._plugins import KwplugPluginManager
from kwplug.accelerator import _keywords, _saving
from kwplug.checkpoint import (
    CheckpointSources,
    RunIdentity,
    SaveArrivals,
    StatePreHooks,
    load_project_state,
    register_for_checkpointing,
    save_project_state,
)
from kwplug.utils.dataclasses import ProjectConfiguration

if TYPE_CHECKING:
    from kwplug.accelerator._agreement import LiveAgreement
    from kwplug.accelerator._gradient_state import GradientState
    from kwplug.accelerator._prepare import _Prepared
    from kwplug.precision import LossScaler


class _SavingAPI:
    """``save``/``save_model``/``get_state_dict``/``unwrap_model``, ``project_dir``, and
    ``register_for_checkpointing``, ``save_state``, ``load_state`` and their pre-hooks of the
    Accelerator (:mod:`kwplug.checkpoint` does the checkpoints' work)."""

    # The Accelerator's attributes this base class reads (set by the facade's __init__),
    # declared here as the other base classes do: no import of the facade (no circle).
    plugin_manager: KwplugPluginManager
    project_configuration: ProjectConfiguration
    process_index: int
    local_process_index: int
    num_processes: int
    device: torch.device
    scaler: LossScaler | None
    gradient_state: GradientState
    _prepared: _Prepared
    _agreement: LiveAgreement

    @property
    def project_dir(self) -> str | None:
        """``project_configuration.project_dir``: the folder for checkpoints, or ``None``."""
        return self.project_configuration.project_dir

    def unwrap_model(
        self,
        model: torch.nn.Module,
        keep_fp32_wrapper: bool = True,
        keep_torch_compile: bool = True,
    ) -> torch.nn.Module:
        """The user's module inside torch's wrappers (DDP, DataParallel) and plugins' (the
        ``unwrap_model`` hook), as Accelerate's ``unwrap_model``.

        Args:
            model: a prepared model.
            keep_fp32_wrapper: ``bool``, default ``True``: keep the mixed-precision forward
                that ``prepare`` installed (autocast, float32 outputs); ``False`` restores the
                model's own ``forward``.
            keep_torch_compile: ``bool``, default ``True``: keep ``torch.compile``'s
                ``OptimizedModule`` around the unwrapped module; ``False`` removes it too.

        Raises:
            TypeError: a flag is not a ``bool``; a plugin's ``unwrap_model`` hook returned
                something that is not a ``torch.nn.Module``.
        """
        _keywords.check_bool("keep_fp32_wrapper", keep_fp32_wrapper)
        _keywords.check_bool("keep_torch_compile", keep_torch_compile)
        return _saving.unwrap(
            model,
            self.plugin_manager,
            keep_fp32_wrapper=keep_fp32_wrapper,
            keep_torch_compile=keep_torch_compile,
        )

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The full state dict (a sharded model's gathered to rank 0, on the CPU)."""
        return _saving.get_state_dict(model, self.plugin_manager, unwrap)

    def save(self, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False) -> None:
        """``torch.save`` (or safetensors) on the main process (each node's with
        ``save_on_each_node``)."""
        if self._writes_files:
            _saving.save(obj, f, safe_serialization)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Save the weights as Accelerate does (same files, same tensors; see
        :mod:`kwplug.accelerator._saving`). Every rank calls it; the main process writes."""
        state_dict = self.get_state_dict(model)
        if self._writes_files:
            _saving.save_model(state_dict, save_directory, max_shard_size, safe_serialization)

    @property
    def _writes_files(self) -> bool:
        config = self.project_configuration
        index = self.local_process_index if config.save_on_each_node else self.process_index
        return index == 0

    # -- checkpoints ------------------------------------------------------------------------

    @functools.cached_property
    def _state_pre_hooks(self) -> StatePreHooks:
        return StatePreHooks()

    @functools.cached_property
    def _checkpoint_run(self) -> RunIdentity:
        # The id automatic naming tags this Accelerator's checkpoints with (_runs.py).
        return RunIdentity()

    @functools.cached_property
    def _save_arrivals(self) -> SaveArrivals:
        # Whether this Accelerator's saves are made by the main process alone (_arrival.py).
        return SaveArrivals()

    def register_save_state_pre_hook(
        self, hook: Callable[..., None]
    ) -> torch.utils.hooks.RemovableHandle:
        """Call ``hook(models, weights, output_dir)`` on every rank in :meth:`save_state`,
        before the models are saved, as Accelerate does: ``models`` the prepared models as
        they were before DDP wrapping (``save_pretrained`` works), ``weights`` their state
        dicts (unwrapped: no ``module.`` prefix), ``output_dir`` the version folder being
        written. Only the dicts left in ``weights`` are saved (a modified one as modified);
        files the hook writes into ``output_dir`` are listed in the manifest and committed
        with the checkpoint, and each top-level name it wrote appears in the checkpoint
        directory itself as a link into the version (``<dir>/unet``, as Accelerate's; see
        :mod:`kwplug.checkpoint._prehooks` and :mod:`kwplug.checkpoint._links`).

        Returns:
            A ``torch.utils.hooks.RemovableHandle``: ``remove()`` unregisters the hook.

        Raises:
            TypeError: ``hook`` is not callable.
            NotImplementedError: (from :meth:`save_state`) a prepared model is sharded.
        """
        return self._state_pre_hooks.register_save(hook)

    def register_load_state_pre_hook(
        self, hook: Callable[..., None]
    ) -> torch.utils.hooks.RemovableHandle:
        """Call ``hook(models, input_dir)`` on every rank in :meth:`load_state` once every file
        is verified, before any model is loaded: ``models`` a list of the prepared models
        (before DDP wrapping);
        those the hook removes from it are not loaded (the others are, in order);
        ``input_dir`` the version folder read.

        Returns:
            A ``torch.utils.hooks.RemovableHandle``: ``remove()`` unregisters the hook.

        Raises:
            TypeError: ``hook`` is not callable.
            NotImplementedError: (from :meth:`load_state`) a prepared model is sharded.
        """
        return self._state_pre_hooks.register_load(hook)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include ``objects`` (each with ``state_dict()`` and ``load_state_dict()``, e.g. an
        LR scheduler or a step counter) in :meth:`save_state` / :meth:`load_state`.

        Raises:
            kwplug.errors.NotCheckpointableError: (a ``ValueError``, as Accelerate's, and a
                ``TypeError``) an object lacks ``state_dict`` or ``load_state_dict``; the
                message lists each one by index, and none of ``objects`` is registered.
        """
        register_for_checkpointing(self._prepared.custom_objects, *objects)

    def _checkpoint_sources(self) -> CheckpointSources:
        # What one save_state/load_state reads: kwplug.checkpoint never sees the Accelerator.
        prepared, plugins = self._prepared, self.plugin_manager

        def handler_state() -> dict[str, Any]:
            # By registered plugin name, so that each plugin gets its own state back.
            answers = plugins.each.handler_state()
            return {name: state for name, state in answers if state is not None}

        def load_handler_state(saved: Mapping[str, Any]) -> None:
            for name, state in saved.items():
                plugins.each_of(name).load_handler_state(state=state)

        return CheckpointSources(
            models=tuple(prepared.models),
            optimizers=tuple(prepared.optimizers),
            dataloaders=tuple(prepared.dataloaders),
            custom_objects=tuple(prepared.custom_objects),
            scaler=self.scaler,
            scaler_updates=prepared.scaler_updates,
            gradient_state=self.gradient_state,
            pre_hooks=self._state_pre_hooks,
            process_index=self.process_index,
            num_processes=self.num_processes,
            device=self.device,
            # Checkpoints hold the module's own keys, never torch.compile's `_orig_mod.`.
            unwrap=functools.partial(self.unwrap_model, keep_torch_compile=False),
            handler_state=handler_state,
            load_handler_state=load_handler_state,
            project_configuration=self.project_configuration,
            run=self._checkpoint_run,
            arrivals=self._save_arrivals,
            agree=self._agreement.check,  # by a save every rank takes part in
            # How sharded models are saved: the wrapping plugin's state_dict_type, if any
            # (pluggy's last-registered answers first, as wrap_model's first answer).
            state_dict_type=next(
                (
                    kind
                    for impl in reversed(plugins.hook_impls("wrap_model"))
                    if (kind := getattr(impl.plugin, "state_dict_type", None)) is not None
                ),
                None,
            ),
        )

    @property
    def save_iteration(self) -> int:
        """``project_configuration.iteration``: the number of the next automatic checkpoint."""
        return self.project_configuration.iteration

    def save_state(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> Path:
        """Save everything needed to resume training exactly, atomically.

        Saves the prepared models (unwrapped ``state_dict``), optimizers, the gradient scaler,
        objects given to :meth:`register_for_checkpointing`, and per rank the RNG states
        (Python, NumPy, torch CPU and device), the prepared data loaders' positions (epoch and
        batches consumed) and the state of stateful DDP communication hooks (saved, restored
        and resized by each hook's :class:`~kwplug.CommHook` rules). Every rank must call it;
        see :mod:`kwplug.checkpoint` for the layout and the crash-safety guarantees.

        Saved between two micro-batches of :meth:`accumulate` (``sync_gradients`` false), it
        also saves each rank's pending ``.grad`` of the prepared models (local, unsynchronised
        under DDP) and the micro-batch count, so that the resumed run is bitwise the
        uninterrupted one; at a synchronising boundary nothing more is written.

        A sharded model (``DTensor`` parameters, e.g. from FSDP2's ``fully_shard``) is saved
        as its full state dict, gathered to rank 0 through
        ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` (same keys and
        shapes as the unsharded model's ``state_dict()``); its optimizer as the full
        optimizer state dict (``get_optimizer_state_dict``, keyed by parameter name).

        Every save increments ``project_configuration.iteration``. With
        ``ProjectConfiguration(automatic_checkpoint_naming=True)`` the checkpoint directory is
        ``<project_dir>/checkpoints/checkpoint_<iteration>``, and ``total_limit`` keeps only
        the newest kwplug checkpoints there once the new one is committed (see
        :mod:`kwplug.checkpoint._naming`).

        Args:
            output_dir: the checkpoint directory: a new version folder is written into it and
                older versions are deleted once it is complete; nothing else there is touched.
                Default ``None``: only with automatic naming (which, as in Accelerate,
                ignores ``output_dir`` with a ``KwplugWarning``).
            safe_serialization: Accelerate's, default ``True``. kwplug writes only
                safetensors: ``False`` (Accelerate: pickled files) saves the same checkpoint,
                with a ``KwplugWarning``.
            save_model_func_kwargs: Accelerate passes them only to DeepSpeed's
                ``save_checkpoint``; kwplug has no DeepSpeed engine and ignores them with a
                ``KwplugWarning`` naming them (Accelerate ignores them without DeepSpeed).

        Returns:
            The checkpoint directory.

        Raises:
            TypeError: ``safe_serialization`` is not a ``bool``.
            ValueError: no ``output_dir`` and no automatic naming; automatic naming without a
                ``project_dir``; ``checkpoint_<iteration>`` exists already (as in Accelerate).
            kwplug.checkpoint.CheckpointError: another process is saving into
                ``output_dir`` (naming its host and pid); a write failed (disk full: the
                unfinished version is removed, the previous one kept); state that a
                checkpoint cannot hold (only tensors, NumPy arrays and JSON values); a save
                mid-accumulation of a sharded model, or between unscaling the gradients and
                the optimizer step.
            NotImplementedError: an optimizer steps a sharded model's parameters together
                with parameters outside that model.
        """
        _keywords.check_save_state(safe_serialization, save_model_func_kwargs)
        return save_project_state(self._checkpoint_sources(), output_dir)

    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: Mapping[str, Any] | None = None,
        *,
        exact_data_position: bool = False,
        **load_model_func_kwargs: Any,
    ) -> Path:
        """Restore what :meth:`save_state` saved into the prepared objects, in place.

        Prepare the same models, optimizers and data loaders, in the same order, before
        calling it. Every rank must call it. Sharded models and their optimizers are read on
        rank 0 and broadcast (``set_model_state_dict`` / ``set_optimizer_state_dict`` with
        ``broadcast_from_rank0=True``); each rank keeps its own shards.

        Every file is verified (manifest, size, xxh3-128 checksum, kind, shapes) before any
        object is loaded; no file is unpickled. A folder Accelerate's ``save_state`` wrote is
        loaded too (switching to kwplug mid-run), its pickles read with
        ``torch.load(weights_only=True)`` and NumPy's RNG array allowed, anything else refused
        by name (:mod:`kwplug.checkpoint._accelerate_layout`).

        The prepared data loaders start the saved epoch at batch 0, as Accelerate's (skip the
        batches already trained with :meth:`skip_first_batches`, as under Accelerate), in the
        saved epoch's order (an INFO log says how many batches the saved position was past);
        with ``exact_data_position=True``, or for loaders prepared with
        ``DataLoaderConfiguration(use_stateful_dataloader=True)``, they resume at the exact
        next batch (see :mod:`kwplug.checkpoint._position`).

        A checkpoint saved by the main process alone (``save_state`` under ``if
        accelerator.is_main_process:``) loads on every process: the others, whose RNG states
        were not saved, keep theirs, with a ``KwplugWarning`` naming the missing file.

        A checkpoint saved by another number of processes loads too: with
        ``exact_data_position=True`` the data loaders go on at the next unconsumed batch of
        the global stream, per-rank RNG states are re-derived
        from rank 0's, per-process communication-hook state is reset with one warning (see
        :mod:`kwplug.checkpoint._resize` and docs/reliability.md).

        Args:
            input_dir: the checkpoint directory. Default ``None``: only with automatic naming,
                the highest-numbered complete ``<project_dir>/checkpoints/checkpoint_<n>``.
                With automatic naming, loading ``checkpoint_<n>`` sets
                ``project_configuration.iteration`` to ``n + 1`` (the next save continues the
                numbering).
            load_kwargs: Accelerate's ``torch.load`` keywords; kwplug never unpickles, so
                non-empty ones are ignored with a ``KwplugWarning``.
            exact_data_position: kwplug's, keyword only, default ``False``: ``True`` resumes
                every prepared data loader at the exact batch after the last one handed out
                before the save (kwplug's bitwise resume); ``False`` starts the saved epoch at
                batch 0, as Accelerate's.
            load_model_func_kwargs: ``map_location`` (``"cpu"`` or ``"on_device"``, as
                Accelerate: either way the states load in place, onto the prepared objects'
                devices) and ``strict`` (``True`` only: the keys and shapes are always
                checked); see :func:`kwplug.accelerator._keywords.check_load_state`.

        Returns:
            The version folder read (the newest complete one in ``input_dir``).

        Raises:
            TypeError: an unknown keyword (Accelerate's model loader raises it too);
                ``load_kwargs`` is not a mapping; ``exact_data_position`` is not a ``bool``.
            ValueError: no ``input_dir`` and no automatic naming; automatic naming without a
                ``project_dir``; ``strict=False``; an unknown ``map_location``.
            FileNotFoundError: no complete checkpoint (kwplug's or Accelerate's) at
                ``input_dir`` (or, with automatic naming, in ``checkpoints``).
            kwplug.checkpoint.CheckpointError: (a ``ValueError``) a file is missing,
                truncated, altered, not regular or not listed; the checkpoint was saved with
                different prepared objects (class, shapes), or by another number of
                processes with state that cannot be moved (a data loader whose batch size
                changed, one sharded by a user's ``DistributedSampler``, a save
                mid-accumulation).
            NotImplementedError: (also from :meth:`save_state`) an optimizer steps a sharded
                model's parameters together with parameters outside that model.
        """
        _keywords.check_load_state(load_kwargs, load_model_func_kwargs)
        _keywords.check_bool("exact_data_position", exact_data_position)
        self._agreement.check("load_state")  # every rank loads: the settings agree first
        checkpoint = attrs.evolve(
            self._checkpoint_sources(), exact_data_position=exact_data_position
        )
        return load_project_state(checkpoint, input_dir)

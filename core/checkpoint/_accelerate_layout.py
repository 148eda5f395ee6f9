"""``load_state`` of a folder Accelerate's ``save_state`` wrote: switching to kwplug mid-run.

Accelerate 1.x writes, flat in its ``output_dir`` (``accelerate/checkpointing.py``):
``model.safetensors`` (``pytorch_model.bin`` without ``safe_serialization``; ``model_<i>``
for the i-th model), ``optimizer.bin`` and ``scheduler.bin`` (``_<i>`` after the first),
``scaler.pt`` (fp16), ``random_states_<rank>.pkl`` (one per process: ``step`` and the Python,
NumPy and torch RNG states), ``custom_checkpoint_<i>.pkl`` (``register_for_checkpointing``'s
objects) and, for some loaders, ``sampler.bin`` or ``dl_state_dict.bin``. All but the
safetensors are pickles, which Accelerate loads with ``weights_only=False`` (running any code
they name). kwplug reads them with ``torch.load(weights_only=True)`` -- torch's restricted
unpickler, which builds tensors and plain containers only -- plus, through
``torch.serialization.safe_globals``, :data:`NUMPY_RNG`: the NumPy globals (array, dtype and
``uint32``'s dtype class, ``_reconstruct``) that
``np.random.get_state()``'s array needs, for ``random_states_<rank>.pkl`` alone. Any other
global (a class, ``os.system`` from a ``__reduce__``) is refused by name
(``torch.serialization.get_unsafe_globals_in_checkpoint`` lists them from the pickle's
opcodes, without building anything), with a :class:`~kwplug.errors.CheckpointError`.

What is restored, as Accelerate's ``load_state`` restores it: each model (into the prepared
model when the file's keys are its keys -- Accelerate saves a DDP model's ``module.`` keys --
else into the unwrapped one), each optimizer, each prepared scheduler, the loss scaler, this
process's RNG states and Accelerate's ``step`` (the gradient-accumulation micro-step), and
each registered object. Every file is read and checked (present, keys and shapes, parameter
groups, the number of registered objects) on every process before anything is loaded; a
refusal on one process is raised on all. Unlike Accelerate, a file this run prepared no object
for (``model_2.safetensors`` with two models, ``scaler.pt`` without fp16) is refused, and the
data loaders' ``sampler.bin``/``dl_state_dict.bin`` (pickled sampler objects, torchdata
states) are not read: the loaders start their epoch at batch 0, with a ``KwplugWarning``. A
sharded (FSDP2) model is refused: Accelerate's FSDP layout (``pytorch_model_fsdp_<i>``,
``.distcp`` files with a pickled ``.metadata``) is not read.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kwplug.checkpoint import _messages as messages
from kwplug.checkpoint import _sharded as sharded
from kwplug.errors import CheckpointError, KwplugWarning

if TYPE_CHECKING:
    from kwplug.checkpoint._sources import CheckpointSources

#: Only Accelerate writes these: the signature of its layout (one per process, always).
_RANDOM_STATES = re.compile(r"random_states_(\d+)\.pkl")
_LOADER_FILES = re.compile(r"(sampler|dl_state_dict)(_\d+)?\.bin")
_NUMBERED = {
    "model": re.compile(r"(?:model|pytorch_model)(?:_(\d+))?\.(?:safetensors|bin)"),
    "optimizer": re.compile(r"optimizer(?:_(\d+))?\.bin"),
    "scheduler": re.compile(r"scheduler(?:_(\d+))?\.bin"),
    "registered object": re.compile(r"custom_checkpoint_(\d+)\.pkl()"),
}


def _numpy_rng_globals() -> list[Any]:
    # np.random.get_state()'s uint32 array, pickled as ndarray.__reduce__ (numpy 1 names the
    # module numpy.core, numpy 2 numpy._core: both names map to the same function).
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency of torch's extras
        return []
    multiarray = getattr(np, "_core", None) or np.core
    reconstruct = multiarray.multiarray._reconstruct
    return [
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),  # the array's dtype, rebuilt with its state (BUILD)
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        (reconstruct, "numpy.core.multiarray._reconstruct"),
    ]


#: The globals allowed beyond torch's ``weights_only`` defaults, in ``random_states_*.pkl``.
NUMPY_RNG = (
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.dtypes.UInt32DType",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct",
)


def found(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` is a checkpoint Accelerate's ``save_state`` wrote (it holds a
    ``random_states_<rank>.pkl``, which Accelerate writes on every save)."""
    path = Path(folder)
    if not path.is_dir():
        return False
    return any(_RANDOM_STATES.fullmatch(p.name) for p in path.iterdir())


def _unpickle(path: Path, allowed: tuple[str, ...] = ()) -> Any:
    """``torch.load(path, weights_only=True)``, with :data:`NUMPY_RNG` allowed when asked.

    Raises:
        CheckpointError: the pickle names a global outside torch's defaults and
            ``allowed`` (named), or cannot be read.
    """
    if not path.is_file():
        raise CheckpointError(f"{path} is missing from the Accelerate checkpoint", path)
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (RuntimeError, pickle.UnpicklingError, ValueError, OSError):
        unsafe = []  # not a zip archive: torch.load's own refusal names the global below
    refused = sorted(set(unsafe) - set(allowed))
    if refused:
        raise CheckpointError(
            f"{path} is refused: its pickle names {', '.join(refused)}, which kwplug does not "
            "load (it reads Accelerate's files with torch.load(weights_only=True): tensors, "
            f"plain containers{' and ' + ', '.join(allowed) if allowed else ''} only; loading "
            "it would run that code)",
            path,
        )
    try:
        with torch.serialization.safe_globals(_numpy_rng_globals() if allowed else []):
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
        # torch's reason, without its advice to retry with weights_only=False
        why = str(exc).split("WeightsUnpickler error:")[-1].split("Check the documentation")[0]
        why = " ".join(why.split()) or type(exc).__name__
        raise CheckpointError(f"{path} is refused: {why}", path) from None


def _numbered(folder: Path, kind: str, count: int) -> None:
    # A file past the prepared objects is refused (Accelerate skips it without a word).
    for child in folder.iterdir():
        match = _NUMBERED[kind].fullmatch(child.name)
        if match and int(match.group(1) or 0) >= count:
            raise CheckpointError(
                f"{child}: this run prepared {count} {kind}(s), so it has no object for it "
                "(prepare the same models, optimizers, schedulers and registered objects as "
                "the run that saved it)",
                child,
            )


def _model_state(folder: Path, index: int) -> tuple[Path, dict[str, torch.Tensor]]:
    ending = f"_{index}" if index else ""
    safe = folder / f"model{ending}.safetensors"
    if safe.is_file():
        from safetensors.torch import load_file

        return safe, load_file(safe, device="cpu")
    path = folder / f"pytorch_model{ending}.bin"
    state = _unpickle(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict", path)
    return path, state


def _tied(own: dict[str, torch.Tensor], missing: set[str], present: set[str]) -> bool:
    # Accelerate's safetensors save keeps one name of tensors sharing storage (tied weights,
    # clean_state_dict_for_safetensors) and safetensors' load_model accepts the others missing.
    storages = {own[k].untyped_storage().data_ptr() for k in present if k in own}
    return all(own[k].untyped_storage().data_ptr() in storages for k in missing)


def _model_target(
    path: Path, state: dict[str, torch.Tensor], prepared: torch.nn.Module, module: torch.nn.Module
) -> torch.nn.Module:
    # Accelerate saves the prepared model's state dict (a DDP model's keys start with
    # `module.`) and loads it into the prepared model: either set of keys is accepted.
    for target in (prepared, module):
        own = target.state_dict(keep_vars=True)
        missing = set(own) - set(state)
        if set(state) <= set(own) and _tied(own, missing, set(state)):
            for key in (k for k in own if k in state):  # in the model's order
                if tuple(own[key].shape) != tuple(state[key].shape):
                    raise CheckpointError(
                        f"{path}: {key} has shape {tuple(state[key].shape)}, the model's is "
                        f"{tuple(own[key].shape)}",
                        path,
                    )
            return target
    own_keys = module.state_dict().keys()
    missing_keys = sorted(own_keys - state.keys())[:5]
    unexpected = sorted(state.keys() - own_keys)[:5]
    raise CheckpointError(
        f"{path} does not hold this model's weights: missing {missing_keys}, unexpected "
        f"{unexpected}",
        path,
    )


def _check_optimizer(path: Path, state: Any, optimizer: torch.optim.Optimizer) -> None:
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or "state" not in state:
        raise CheckpointError(f"{path} does not hold an optimizer state dict", path)
    sizes = [len(g["params"]) for g in groups]
    own = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != own:
        raise CheckpointError(
            f"{path}: parameter groups of sizes {sizes}, the optimizer's are {own}", path
        )


def _read(sources: CheckpointSources, folder: Path) -> dict[str, Any]:
    """Every file this process loads, read and checked; nothing is loaded yet."""
    plan: dict[str, Any] = {}
    _numbered(folder, "model", len(sources.models))
    models = []
    for i, prepared in enumerate(sources.models):
        if sharded.is_sharded(sources.unwrap(prepared)):
            raise CheckpointError(
                f"{folder} is an Accelerate checkpoint and model {i} is sharded (DTensor, "
                "FSDP2): kwplug reads Accelerate's unsharded layout only (not its "
                "pytorch_model_fsdp_<i> folders); resume it without sharding, save_state, "
                "then load that kwplug checkpoint into the sharded run",
                folder,
            )
        path, state = _model_state(folder, i)
        models.append((_model_target(path, state, prepared, sources.unwrap(prepared)), state))
    plan["models"] = models
    _numbered(folder, "optimizer", len(sources.optimizers))
    optimizers = []
    for i, optimizer in enumerate(sources.optimizers):
        path = folder / (f"optimizer_{i}.bin" if i else "optimizer.bin")
        state = _unpickle(path)
        _check_optimizer(path, state, optimizer)
        optimizers.append((optimizer, state))
    plan["optimizers"] = optimizers
    schedulers = messages.schedulers(sources)
    _numbered(folder, "scheduler", len(schedulers))
    plan["schedulers"] = [
        (s, _unpickle(folder / (f"scheduler_{i}.bin" if i else "scheduler.bin")))
        for i, s in enumerate(schedulers)
    ]
    objects = messages.custom_objects(sources)
    files = sorted(
        p.name for p in folder.iterdir() if _NUMBERED["registered object"].fullmatch(p.name)
    )
    if len(files) != len(objects):
        raise CheckpointError(
            f"Number of custom checkpoints in folder {folder} does not match the number of "
            f"registered objects: found {len(files)} checkpoints, {len(objects)} registered "
            "objects (register the same objects as the run that saved it)",
            folder,
        )
    paths = [folder / f"custom_checkpoint_{i}.pkl" for i in range(len(objects))]
    plan["custom"] = [(o, _unpickle(p), str(p)) for o, p in zip(objects, paths, strict=True)]
    scaler = folder / "scaler.pt"
    if sources.scaler is not None:
        plan["scaler"] = _unpickle(scaler)
    elif scaler.is_file():
        raise CheckpointError(
            f"{scaler}: this run has no loss scaler for it (the run that saved it trained "
            "with mixed_precision='fp16')",
            scaler,
        )
    rng = folder / f"random_states_{sources.process_index}.pkl"
    plan["rng"] = _unpickle(rng, NUMPY_RNG) if rng.is_file() else None
    if plan["rng"] is not None and not (
        isinstance(plan["rng"], dict)
        and {"random_state", "numpy_random_seed", "torch_manual_seed"} <= plan["rng"].keys()
    ):
        raise CheckpointError(f"{rng} does not hold Accelerate's random states", rng)
    return plan


def _set_rng(sources: CheckpointSources, states: dict[str, Any]) -> None:
    random.setstate(states["random_state"])
    try:
        import numpy as np

        np.random.set_state(states["numpy_random_seed"])
    except ImportError:  # pragma: no cover - numpy is installed wherever Accelerate saved
        pass
    torch.set_rng_state(states["torch_manual_seed"])
    device = sources.device
    key = f"torch_{device.type}_manual_seed"
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and key in states and module is not None:
        # Accelerate saves get_rng_state_all() (every device of this process) for CUDA/XPU.
        saved = states[key]
        if isinstance(saved, list | tuple) and hasattr(module, "set_rng_state_all"):
            module.set_rng_state_all(saved)
        else:
            module.set_rng_state(saved)
    if "step" in states:  # Accelerate's `accelerator.step`: the micro-step of accumulation
        position = sources.gradient_state.state_dict()
        position["step"] = int(states["step"])
        sources.gradient_state.load_state_dict(position)


def load_state(sources: CheckpointSources, input_dir: str | os.PathLike[str]) -> Path:
    """Restore the Accelerate checkpoint ``input_dir`` into ``sources`` (every process calls
    it; each reads the shared files and its own ``random_states_<rank>.pkl``).

    Returns:
        ``input_dir``, absolute.

    Raises:
        CheckpointError: on every process, when any process refused a file (missing, a
            pickle naming a global outside the allow-list, keys or shapes of another model,
            another number of registered objects or prepared objects).
    """
    folder = Path(input_dir).absolute()
    error: CheckpointError | None = None
    plan: dict[str, Any] = {}
    try:
        plan = _read(sources, folder)
    except CheckpointError as exc:
        error = exc
    sources.raise_together(error, "another process refused", folder)
    for target, state in plan["models"]:
        # strict=False only for the tied names the file holds once (checked in _read)
        target.load_state_dict(state, strict=False)
    for optimizer, state in plan["optimizers"]:
        optimizer.load_state_dict(state)
    for scheduler, state in plan["schedulers"]:
        scheduler.load_state_dict(state)
    loaders = sorted(p.name for p in folder.iterdir() if _LOADER_FILES.fullmatch(p.name))
    if loaders and sources.is_main_process:
        warnings.warn(
            f"load_state({folder}): Accelerate's data loader state ({', '.join(loaders)}) is "
            "not read (a pickled sampler or torchdata's state); the prepared data loaders "
            "start their epoch at batch 0",
            KwplugWarning,
            stacklevel=4,
        )
    if sources.scaler is not None:
        sources.scaler.load_state_dict(plan["scaler"])
    if plan["rng"] is not None:
        _set_rng(sources, plan["rng"])
    else:
        warnings.warn(
            f"load_state({folder}): no random_states_{sources.process_index}.pkl (saved by "
            "fewer processes, or by the main process alone): this process keeps its RNG states",
            KwplugWarning,
            stacklevel=4,
        )
    custom = plan["custom"]
    messages.loaded(
        sources, random_states=plan["rng"] is not None, custom_files=[p for *_, p in custom]
    )
    for obj, state, _ in custom:
        obj.load_state_dict(state)
    return folder

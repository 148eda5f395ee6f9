"""Accelerate's ``accelerate.utils.modeling`` names: :func:`load_checkpoint_in_model` (the
weights ``save_model`` wrote, back into a model) is supported without a device map;
:func:`infer_auto_device_map` and :func:`get_state_dict_from_offload` (big-model inference)
exist with Accelerate's signatures and raise ``NotImplementedError`` naming their row of
docs/migrating-from-accelerate.md."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "get_state_dict_from_offload",
    "has_offloaded_params",
    "infer_auto_device_map",
    "load_checkpoint_in_model",
]

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")


def _not_supported(name: str, detail: str = "") -> NotImplementedError:
    return NotImplementedError(
        f"{name}{detail}: big-model inference (device maps, CPU/disk offloading) is not part "
        f"of kwplug; see the `{name}` row of docs/migrating-from-accelerate.md"
    )


def load_checkpoint_in_model(
    model: torch.nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: dict[str, int | str | torch.device] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> None:
    """Load a checkpoint's weights into ``model`` in place (Accelerate's, without a device map).

    ``checkpoint`` is a weights file (``.safetensors``, or ``.bin``/``.pt`` read with
    ``torch.load(weights_only=True)``: nothing is unpickled beyond torch's allow-list), a
    ``*.index.json`` of shards, or a folder holding one of those -- what
    ``accelerator.save_model`` writes. A model built under ``init_empty_weights`` (``meta``
    parameters) gets the loaded tensors themselves (``load_state_dict(assign=True)``), as does
    any model when ``dtype`` is given (its weights take that dtype, as with Accelerate).
    The big-model inference options (``device_map``, ``offload_folder``,
    ``offload_state_dict``, ``offload_buffers``, ``keep_in_fp32_modules``,
    ``offload_8bit_bnb``, ``full_state_dict``, ``broadcast_from_rank0``) accept only their
    defaults.

    Args:
        model: the model to fill.
        checkpoint: file or folder, as above.
        dtype: cast floating-point weights to this dtype (``"float16"`` or a
            ``torch.dtype``). Default ``None``: as saved.
        strict: every model key must be in the checkpoint and no other (``load_state_dict``'s
            ``strict``). Default ``False``, as Accelerate's.

    Raises:
        NotImplementedError: a big-model inference option is given.
        ValueError: the folder holds no weights file, or several without an index.
        RuntimeError: ``strict`` and the keys differ, or a shape differs (torch's).
    """
    given = {
        "device_map": device_map is not None,
        "offload_folder": offload_folder is not None,
        "offload_state_dict": offload_state_dict,
        "offload_buffers": offload_buffers,
        "keep_in_fp32_modules": keep_in_fp32_modules is not None,
        "offload_8bit_bnb": offload_8bit_bnb,
        "full_state_dict": not full_state_dict,
        "broadcast_from_rank0": broadcast_from_rank0,
    }
    for name, set_ in given.items():
        if set_:
            raise _not_supported("load_checkpoint_in_model", f"({name}=...)")
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(checkpoint)):
        state.update(_read(file))
    if dtype is not None:
        target = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        state = {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}
    # Assigned (not copied into the current tensors) when those have no storage, or when
    # dtype asks for another dtype than theirs: Accelerate's weights take the loaded dtype.
    on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    model.load_state_dict(state, strict=strict, assign=on_meta or dtype is not None)


def _weight_files(checkpoint: Path) -> list[Path]:
    if checkpoint.is_file() and checkpoint.name.endswith(".index.json"):
        index = json.loads(checkpoint.read_text())
        shards = dict.fromkeys(index["weight_map"].values())
        return [checkpoint.parent / name for name in shards]
    if checkpoint.is_file():
        return [checkpoint]
    indexes = sorted(checkpoint.glob("*.index.json"))
    if len(indexes) == 1:
        return _weight_files(indexes[0])
    files = sorted(p for p in checkpoint.iterdir() if p.suffix in _WEIGHTS and p.is_file())
    if len(files) != 1:
        raise ValueError(
            f"load_checkpoint_in_model: {checkpoint} must hold one weights file "
            f"({', '.join(_WEIGHTS)}) or one *.index.json, found {[p.name for p in files]}"
        )
    return files


def _read(file: Path) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(file)
    loaded = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(loaded, dict):
        raise ValueError(f"load_checkpoint_in_model: {file} holds no state dict")
    return loaded


def infer_auto_device_map(
    model: torch.nn.Module,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict[str, str | torch.dtype] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> dict[str, int | str | torch.device]:
    """Not supported (device maps for big-model inference): Accelerate's signature, so that
    scripts import. kwplug shards a model for training with the ``fsdp``/``parallelism``
    plugins instead.

    Raises:
        NotImplementedError: always, naming the migration row.
    """
    raise _not_supported("infer_auto_device_map")


def get_state_dict_from_offload(
    module: torch.nn.Module,
    module_name: str,
    state_dict: dict[str, Any],
    device_to_put_offload: int | str | torch.device = "cpu",
) -> dict[str, Any]:
    """Not supported (offloaded weights): Accelerate's signature, so that scripts import.

    Raises:
        NotImplementedError: always, naming the migration row.
    """
    raise _not_supported("get_state_dict_from_offload")


def has_offloaded_params(module: torch.nn.Module) -> bool:
    """Whether ``module`` carries an offloading hook: an ``AlignDevicesHook`` with
    ``offload=True`` as its ``_hf_hook`` (kwplug's, from
    ``kwplug.hooks.attach_align_device_hook(..., offload=True)``, or Accelerate's, which
    transformers' ``device_map`` offloading attaches; recognised by its class name, without
    importing either).

    Args:
        module: the module to check.
    """
    hook = getattr(module, "_hf_hook", None)
    return type(hook).__name__ == "AlignDevicesHook" and getattr(hook, "offload", False) is True

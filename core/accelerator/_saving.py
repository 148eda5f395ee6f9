"""``Accelerator.save``, ``save_model``, ``get_state_dict`` and ``unwrap_model``.

``save_model`` writes what Accelerate's writes, file for file: ``model.safetensors`` (or
``pytorch_model.bin``), or shards ``model-00001-of-0000N.safetensors`` with
``model.safetensors.index.json`` when the weights exceed ``max_shard_size``. The split is the
same greedy split as ``huggingface_hub.split_torch_state_dict_into_shards`` (which Accelerate
calls), written here so that kwplug does not depend on the Hub client for thirty lines.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch

from kwplug._plugins import KwplugPluginManager
from kwplug._process.rank_logging import rank_logger
from kwplug._runtime import dedupe_shared, storage_key, write
from kwplug._runtime import unwrap as unwrap  # unwrap_model's, shared with kwplug.utils
from kwplug.checkpoint import full_model_state, is_sharded

logger = logging.getLogger(__name__)
#: Accelerate's lines, as its ``save_model`` logs them (main process, INFO).
accelerate_logger = rank_logger(__name__)

#: ``Accelerator.save``'s writer (``kwplug.utils.save`` shares it, with the weights-only check).
save = write

SAFE_WEIGHTS_PATTERN = "model{suffix}.safetensors"
WEIGHTS_PATTERN = "pytorch_model{suffix}.bin"
_SHARD = re.compile(r"(.*?)-\d{5}-of-\d{5}")
# Decimal units, as huggingface_hub.parse_size_to_int (so "10GB" splits where Accelerate does).
_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def get_state_dict(
    model: torch.nn.Module, plugins: KwplugPluginManager, unwrap_first: bool
) -> dict[str, torch.Tensor]:
    """The model's full state dict: ``state_dict()`` of the unwrapped model, or for a sharded
    model (``DTensor`` parameters, FSDP2) the full tensors gathered to rank 0 on the CPU
    (other ranks get an empty dict)."""
    if unwrap_first:
        model = unwrap(model, plugins)
    if is_sharded(model):
        return cast("dict[str, torch.Tensor]", full_model_state(model))
    return _onloaded(model, model.state_dict())


def _offload_hooks(hook: Any) -> list[Any]:
    # An offloading hook (kwplug.hooks.AlignDevicesHook or Accelerate's), alone or chained.
    hooks = getattr(hook, "hooks", (hook,))
    return [h for h in hooks if getattr(h, "offload", False) and getattr(h, "weights_map", None)]


def _onloaded(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the tensors an offloading hook keeps on ``meta`` between forwards
    replaced by the hook's own (Accelerate's ``get_state_dict_offloaded_model``)."""
    for name, module in model.named_modules():
        for hook in _offload_hooks(getattr(module, "_hf_hook", None)):
            prefix = f"{name}." if name else ""
            for key in hook.weights_map:
                full = prefix + key
                if full in state and state[full].is_meta:
                    state[full] = hook.weights_map[key].to("cpu")
    return state


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an ``int``, or digits and a unit among TB, GB, MB, KB (decimal).

    Raises:
        TypeError: neither an ``int`` nor a ``str`` (a ``bool`` too).
        ValueError: an unknown unit, an unparsable number, or a negative size (Accelerate's
            ``convert_file_size_to_int`` rule).
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(
            f"max_shard_size must be an int (bytes) or a str such as '10GB', got {size!r} of "
            f"type {type(size).__name__}"
        )
    if isinstance(size, int):
        number = size
    else:
        text = size.strip()
        unit = text[-2:].upper()
        if unit not in _UNITS:
            raise ValueError(f"max_shard_size: unit of {size!r} must be one of TB, GB, MB, KB")
        try:
            number = int(float(text[:-2].strip()) * _UNITS[unit])
        except ValueError:
            raise ValueError(f"max_shard_size: cannot read the number in {size!r}") from None
    if number < 0:
        raise ValueError(f"max_shard_size must be >= 0 bytes, got {size!r}")
    return number


def split_shards(state_dict: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Names per shard, in order: a new shard starts when the next tensor would exceed
    ``max_bytes``; a tensor larger than that gets a shard of its own; tensors sharing storage
    go to the shard of the first of them (Accelerate's split, through huggingface_hub)."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    followers: dict[tuple[Any, ...], list[str]] = {}
    for name, tensor in state_dict.items():
        key = storage_key(tensor)
        if key in followers:
            followers[key].append(name)
            continue
        followers[key] = [name]
        nbytes = tensor.untyped_storage().nbytes()
        if nbytes > max_bytes:
            shards.append([name])
            continue
        if size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        shards.append(current)
    for names in followers.values():
        shard = next(s for s in shards if names[0] in s)
        shard.extend(names[1:])
    return shards


def save_model(
    state_dict: dict[str, torch.Tensor],
    save_directory: str | os.PathLike[str],
    max_shard_size: int | str,
    safe_serialization: bool,
) -> list[str]:
    """Write ``state_dict`` into ``save_directory`` as Accelerate's ``save_model`` does.

    ``model.safetensors`` (``pytorch_model.bin`` without ``safe_serialization``), or when the
    weights exceed ``max_shard_size`` (bytes, or e.g. ``"5MB"``, decimal units) shards
    ``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json``. Tied weights
    are saved once, under the first name. Shard files of an earlier save that this one does
    not overwrite are removed.

    Returns:
        The weight file names written.

    Raises:
        FileExistsError: ``save_directory`` is a file.
        ValueError: ``max_shard_size`` cannot be read.
    """
    directory = Path(save_directory)
    if directory.is_file():
        raise FileExistsError(f"save_model: {directory} is a file, not a directory")
    if safe_serialization:
        state_dict = dedupe_shared(state_dict)
    pattern = SAFE_WEIGHTS_PATTERN if safe_serialization else WEIGHTS_PATTERN
    shards = split_shards(state_dict, parse_size(max_shard_size))
    count = len(shards)
    names = [
        pattern.format(suffix="" if count == 1 else f"-{i:05d}-of-{count:05d}")
        for i in range(1, count + 1)
    ]
    directory.mkdir(parents=True, exist_ok=True)
    for stale in _stale_shards(directory, pattern, names):
        stale.unlink()
    for name, keys in zip(names, shards, strict=True):
        save({key: state_dict[key] for key in keys}, directory / name, safe_serialization)
    if count > 1:
        index = {
            "metadata": {"total_size": sum(_storage_sizes(state_dict))},
            "weight_map": {
                key: name for name, keys in zip(names, shards, strict=True) for key in keys
            },
        }
        index_name = pattern.format(suffix="") + ".index.json"
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        (directory / index_name).write_text(text, encoding="utf-8")
        accelerate_logger.info(
            f"The model is bigger than the maximum size per checkpoint ({max_shard_size}) and "
            f"is going to be split in {count} checkpoint shards. You can find where each "
            f"parameters has been saved in the index located at {directory / index_name}."
        )
    else:  # Accelerate names pytorch_model.bin here whatever it wrote: its words, kept
        accelerate_logger.info(
            f"Model weights saved in {os.path.join(save_directory, 'pytorch_model.bin')}"
        )
    return names


def _stale_shards(directory: Path, pattern: str, keep: list[str]) -> Iterator[Path]:
    stem, suffix = pattern.format(suffix=""), pattern.rsplit(".", 1)[1]
    base = stem.removesuffix("." + suffix)
    for path in directory.iterdir():
        if (
            path.is_file()
            and path.name.startswith(base)
            and path.name not in keep
            and _SHARD.fullmatch(path.name.removesuffix("." + suffix)) is not None
        ):
            yield path


def _storage_sizes(state_dict: Mapping[str, torch.Tensor]) -> Iterator[int]:
    seen = set()
    for tensor in state_dict.values():
        key = storage_key(tensor)
        if key not in seen:
            seen.add(key)
            yield tensor.untyped_storage().nbytes()

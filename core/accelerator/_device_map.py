"""A model loaded with a device map (transformers' ``from_pretrained(device_map=...)``, which
sets ``model.hf_device_map``) at ``prepare``: Accelerate's checks, and the model left where the
map put it.

Accelerate's ``prepare_model`` (1.16) refuses, with a ``ValueError`` in these words:

- a model spread over several devices (``verify_device_map``) in a run of several processes
  (unless ``ACCELERATE_BYPASS_DEVICE_MAP=true``);
- a model loaded in 8-bit or 4-bit (``is_loaded_in_8bit``/``is_loaded_in_4bit``, set by
  transformers' bitsandbytes integration) with a device map: over several devices in a run of
  several processes, on one device other than the training device, or with a part on the CPU
  (unless bitsandbytes has its multi-backend, which trains on the CPU; never on an XPU
  machine) or on disk.

Such a model is not moved to the Accelerator's device (a quantized model cannot be:
bitsandbytes' ``.to()`` raises; a device-mapped one would be collapsed onto one device).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

import torch


def spread_over_devices(model: torch.nn.Module) -> bool:
    """True when a submodule of ``model`` has an ``hf_device_map`` of more than one entry
    (loaded with big model inference, e.g. ``device_map="auto"``; Accelerate's
    ``verify_device_map``)."""
    return any(len(getattr(m, "hf_device_map", ())) > 1 for m in model.modules())


def _bitsandbytes_trains_on_cpu() -> bool:
    # Accelerate's is_bitsandbytes_multi_backend_available(); imported only for a quantized
    # model with a part mapped to the CPU.
    if importlib.util.find_spec("bitsandbytes") is None:
        return False
    return "multi_backend" in getattr(importlib.import_module("bitsandbytes"), "features", set())


def _xpu_machine() -> bool:
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


def _index(device: Any) -> int | None:
    if isinstance(device, torch.device):
        return device.index
    if device == "disk":  # not a torch device: the offload check below names it
        return None
    if isinstance(device, str):
        return torch.device(device).index
    return None if device is None else int(device)


def stays_where_mapped(model: torch.nn.Module, device: torch.device, world_size: int) -> bool:
    """Accelerate's checks of a device-mapped model at ``prepare``; ``True`` when ``model``
    must be left where its device map put it (not moved to ``device``).

    Args:
        model: the module being prepared.
        device: the Accelerator's device.
        world_size: the number of processes (more than one: Accelerate's distributed modes).

    Raises:
        ValueError: a case the module docstring lists, in Accelerate's words.
    """
    spread = spread_over_devices(model)
    if (
        spread
        and world_size > 1
        and os.environ.get("ACCELERATE_BYPASS_DEVICE_MAP", "false").lower() != "true"
    ):
        raise ValueError(
            "You can't train a model that has been loaded with `device_map='auto'` in any "
            "distributed mode. Please rerun your script specifying `--num_processes=1` or by "
            "launching with `python {{myscript.py}}`."
        )
    quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(
        model, "is_loaded_in_4bit", False
    )
    device_map = getattr(model, "hf_device_map", None)
    if not (quantized and device_map):
        return spread
    devices = set(device_map.values())
    if len(devices) > 1 and world_size > 1:
        raise ValueError(
            "You can't train a model that has been loaded in 8-bit or 4-bit precision on "
            "multiple devices in any distributed mode. In order to use 8-bit or 4-bit models "
            "that have been loaded across multiple GPUs the solution is to use Naive Pipeline "
            "Parallelism. Therefore you should not specify that you are under any distributed "
            "regime in your accelerate config."
        )
    if len(devices) == 1:
        index = _index(next(iter(devices)))
        mapped = torch.device(device.type) if index is None else torch.device(device.type, index)
        if device.type == "cpu" and _bitsandbytes_trains_on_cpu():
            pass  # bitsandbytes' multi-backend trains on the CPU, any index
        elif mapped != device and (device.index is not None or index != 0):
            raise ValueError(
                "You can't train a model that has been loaded in 8-bit or 4-bit precision on a "
                "different device than the one you're training on. Make sure you loaded the "
                "model on the correct device using for example "
                "`device_map={'':torch.cuda.current_device()}` or "
                "`device_map={'':torch.xpu.current_device()}`"
            )
    if ("cpu" in devices and (not _bitsandbytes_trains_on_cpu() or _xpu_machine())) or (
        "disk" in devices
    ):
        raise ValueError(
            "You can't train a model that has been loaded in 8-bit or 4-bit precision with CPU "
            "or disk offload. If you want train the 8-bit or 4-bit model in CPU, please install "
            "bitsandbytes with multi-backend, see "
            "https://huggingface.co/docs/bitsandbytes/main/en/installation#multi-backend"
        )
    return True

"""Accelerate's launch configuration file (``accelerate config``'s YAML or JSON), read for
``kwplug launch --config_file`` and ``kwplug env``.

The keys are those of Accelerate's ``ClusterConfig`` (``accelerate/commands/config/
config_args.py``), with its defaults and its two legacy keys (``fp16``, ``dynamo_backend``).
kwplug uses the keys that configure a torchrun launch; a key asking for something kwplug does
not do (DeepSpeed, Megatron-LM, TPU, fp8, SageMaker, mpirun...) is refused by name when it
holds anything but its default, never ignored.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kwplug._cli.launch_sharding import config_settings

__all__ = ["LaunchConfigError", "default_config_file", "load_mapping", "read_config"]

#: The keys kwplug uses, with Accelerate's defaults (``ClusterConfig``).
USED: Mapping[str, Any] = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": None,
    "mixed_precision": None,
    "use_cpu": False,
    "num_processes": -1,
    "machine_rank": 0,
    "num_machines": 1,
    "main_process_ip": None,
    "main_process_port": None,
    "rdzv_backend": "static",
    "same_network": False,  # a static rendezvous reaches MASTER_ADDR either way
    "main_training_function": "main",  # notebook and TPU launches only
    "dynamo_config": {},
    # distributed_type FSDP's settings and the device mesh's (kwplug._cli.launch_sharding)
    "fsdp_config": {},
    "parallelism_config": {},
}

#: Accelerate's keys kwplug accepts only at their default, each with what to do instead.
REFUSED: Mapping[str, str] = {
    "debug": "kwplug has no debug mode (ACCELERATE_DEBUG_MODE)",
    "gpu_ids": "set CUDA_VISIBLE_DEVICES (or your device's variable) instead",
    "enable_cpu_affinity": "kwplug launch sets no CPU affinity",
    "fp8_config": "kwplug has no fp8 training",
    "deepspeed_config": "kwplug has no DeepSpeed integration",
    "megatron_lm_config": "kwplug has no Megatron-LM integration",
    "mpirun_config": "kwplug launch runs torch.distributed.run, not mpirun",
    "downcast_bf16": "kwplug has no TPU/XLA support",
    "tpu_name": "kwplug has no TPU/XLA support",
    "tpu_zone": "kwplug has no TPU/XLA support",
    "tpu_use_cluster": "kwplug has no TPU/XLA support",
    "tpu_use_sudo": "kwplug has no TPU/XLA support",
    "command_file": "kwplug has no TPU/XLA support",
    "commands": "kwplug has no TPU/XLA support",
    "tpu_vm": "kwplug has no TPU/XLA support",
    "tpu_env": "kwplug has no TPU/XLA support",
}

#: ``distributed_type`` values a torchrun launch serves (``MULTI_CPU`` included: kwplug starts
#: ``num_processes`` processes where Accelerate would need ``mpirun``).
LAUNCHABLE = frozenset(
    {"NO", "MULTI_CPU", "FSDP", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA"}
    | {"MULTI_MUSA", "MULTI_HPU", "MULTI_NEURON"}
)
_DYNAMO_DEFAULTS: Mapping[str, Any] = {
    "dynamo_mode": "default",
    "dynamo_use_fullgraph": False,
    "dynamo_use_dynamic": False,
    "dynamo_use_regional_compilation": False,
}


class LaunchConfigError(ValueError):
    """The configuration file cannot be used; the message names the file and the key."""


def default_config_file() -> Path:
    """Where ``accelerate config`` writes: ``$HF_HOME/accelerate/default_config.yaml``
    (``HF_HOME`` defaults to ``$XDG_CACHE_HOME/huggingface``, ``~/.cache/huggingface``)."""
    cache = os.environ.get("XDG_CACHE_HOME", "~/.cache")
    home = os.environ.get("HF_HOME", os.path.join(cache, "huggingface"))
    return Path(os.path.expanduser(home)) / "accelerate" / "default_config.yaml"


def load_mapping(path: Path) -> dict[str, Any]:
    """The file's ``{key: value}``: JSON for ``.json``, else YAML (``yaml.safe_load``: plain
    data only, no object is constructed).

    Raises:
        LaunchConfigError: PyYAML is not installed (the message names the ``launch`` extra),
            or the file does not hold a mapping.
        ValueError: the file is not valid JSON/YAML.
    """
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        try:
            import yaml
        except ModuleNotFoundError:
            raise LaunchConfigError(
                f"{path}: reading a YAML config file needs PyYAML: pip install 'kwplug[launch]' "
                "(or pyyaml), or write the same keys as a .json file"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise LaunchConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise LaunchConfigError(f"{path}: expected a mapping of Accelerate's config keys")
    return data


def _is_default(value: Any) -> bool:
    return value in (None, False, "no", "NO", "all") or value == {} or value == []


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The launch settings of an Accelerate config file, as ``kwplug launch`` uses them.

    Args:
        path: a ``.yaml``/``.yml`` (needs PyYAML, the ``launch`` extra) or ``.json`` file.

    Returns:
        ``{key: value}`` for the keys of :data:`USED` the file sets (legacy ``fp16: true``
        becomes ``mixed_precision: fp16``; ``dynamo_config`` becomes ``dynamo_backend``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not valid JSON.
        LaunchConfigError: not valid YAML; not a mapping; no ``distributed_type`` (as
            Accelerate); an unknown key; a key of :data:`REFUSED` set to something else
            than its default; a ``distributed_type`` or ``compute_environment`` it cannot
            launch;
            ``mixed_precision`` not ``no``/``fp16``/``bf16``; PyYAML missing.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"The config file {str(file)!r} does not exist")
    data = dict(load_mapping(file))
    if "fp16" in data:  # Accelerate's legacy key
        fp16 = data.pop("fp16")
        data.setdefault("mixed_precision", "fp16" if fp16 else None)
    if "dynamo_backend" in data:  # legacy too
        backend = data.pop("dynamo_backend")
        data.setdefault("dynamo_config", {} if backend == "NO" else {"dynamo_backend": backend})
    unknown = sorted(set(data) - set(USED) - set(REFUSED))
    if unknown:
        raise LaunchConfigError(
            f"{file}: unknown key(s) {unknown}; Accelerate's keys are {sorted({*USED, *REFUSED})}"
        )
    for key, why in REFUSED.items():
        if key in data and not _is_default(data[key]):
            raise LaunchConfigError(f"{file}: {key}={data[key]!r} is not supported: {why}")
    if "distributed_type" not in data:
        raise LaunchConfigError(f"{file}: a `distributed_type` must be specified (as Accelerate)")
    settings = {key: data[key] for key in USED if key in data}
    _check_values(file, settings)
    try:
        sharding = config_settings(str(file), data)
    except ValueError as exc:
        raise LaunchConfigError(str(exc)) from None
    settings.pop("fsdp_config", None)
    settings.pop("parallelism_config", None)
    return {**settings, **sharding}


def _check_values(file: Path, settings: dict[str, Any]) -> None:
    environment = settings.get("compute_environment") or "LOCAL_MACHINE"
    if environment != "LOCAL_MACHINE":
        raise LaunchConfigError(
            f"{file}: compute_environment={environment!r}: kwplug launch runs on this "
            "machine only (LOCAL_MACHINE)"
        )
    kind = str(settings["distributed_type"])
    if kind not in LAUNCHABLE:
        why = {
            "DEEPSPEED": REFUSED["deepspeed_config"],
            "MEGATRON_LM": REFUSED["megatron_lm_config"],
        }.get(kind, "kwplug launch starts torch.distributed.run processes only")
        raise LaunchConfigError(f"{file}: distributed_type={kind!r} is not supported: {why}")
    precision = settings.get("mixed_precision")
    if precision is not None and str(precision).lower() not in ("no", "fp16", "bf16"):
        raise LaunchConfigError(
            f"{file}: mixed_precision must be 'no', 'fp16' or 'bf16', got {precision!r}"
        )
    dynamo = dict(settings.pop("dynamo_config", None) or {})
    backend = dynamo.pop("dynamo_backend", None)
    for key, value in dynamo.items():
        if key not in _DYNAMO_DEFAULTS:
            raise LaunchConfigError(f"{file}: dynamo_config has an unknown key {key!r}")
        if value not in (_DYNAMO_DEFAULTS[key], None):
            raise LaunchConfigError(
                f"{file}: dynamo_config.{key}={value!r} is not supported: pass "
                "Accelerator(dynamo_plugin=TorchDynamoPlugin(...)) in the script"
            )
    if backend is not None:
        settings["dynamo_backend"] = str(backend)

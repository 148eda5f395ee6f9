"""``is_*_available`` and version checks with Accelerate's names.

Package checks look the package up (``importlib.util.find_spec``) and read its installed
metadata, without importing it: a folder that merely shadows a package name does not count.
Device checks import nothing beyond torch unless the device's extension package is installed.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import operator
from collections.abc import Callable
from typing import Any

import torch

from kwplug.utils.environment import patch_environment

__all__ = [
    "compare_versions",
    "is_bf16_available",
    "is_boto3_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_dvclive_available",
    "is_fp16_available",
    "is_hpu_available",
    "is_matplotlib_available",
    "is_mlflow_available",
    "is_mlu_available",
    "is_mps_available",
    "is_musa_available",
    "is_neuron_available",
    "is_npu_available",
    "is_pandas_available",
    "is_peft_available",
    "is_pytest_available",
    "is_rich_available",
    "is_schedulefree_available",
    "is_sdaa_available",
    "is_swanlab_available",
    "is_tensorboard_available",
    "is_timm_available",
    "is_torch_distributed_available",
    "is_torch_version",
    "is_torch_xla_available",
    "is_torchdata_available",
    "is_torchdata_stateful_dataloader_available",
    "is_torchvision_available",
    "is_tqdm_available",
    "is_trackio_available",
    "is_transformers_available",
    "is_wandb_available",
    "is_xpu_available",
]

_OPERATIONS: dict[str, Callable[[Any, Any], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}


def _is_package_available(import_name: str, distribution: str | None = None) -> bool:
    """True when ``import_name`` can be imported and its distribution is installed."""
    try:
        if importlib.util.find_spec(import_name) is None:
            return False
    except (ImportError, ValueError):  # a broken parent package or a half-imported module
        return False
    try:
        importlib.metadata.metadata(distribution or import_name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def compare_versions(library_or_version: Any, operation: str, requirement_version: str) -> bool:
    """Compare an installed distribution's version (given by name) or a version with
    ``requirement_version`` using ``operation``.

    Args:
        library_or_version: a distribution name (``"torch"``) or a ``packaging`` ``Version``.
        operation: one of ``">"``, ``">="``, ``"=="``, ``"!="``, ``"<="``, ``"<"``.
        requirement_version: the version to compare with (``"2.4"``).

    Raises:
        ValueError: an unknown ``operation``.
        importlib.metadata.PackageNotFoundError: the named distribution is not installed.
    """
    from packaging.version import Version, parse

    if operation not in _OPERATIONS:
        raise ValueError(f"operation must be one of {list(_OPERATIONS)}, got {operation!r}")
    version = library_or_version
    if isinstance(version, str):
        version = parse(importlib.metadata.version(version))
    if not isinstance(version, Version):
        raise TypeError(f"expected a distribution name or a Version, got {version!r}")
    return _OPERATIONS[operation](version, parse(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """Compare the installed torch version with ``version`` (``is_torch_version(">=", "2.4")``).

    Raises:
        ValueError: an unknown ``operation`` (see :func:`compare_versions`).
    """
    return compare_versions("torch", operation, version)


def is_torch_distributed_available() -> bool:
    """``torch.distributed.is_available()``."""
    return bool(torch.distributed.is_available())


# -- packages ---------------------------------------------------------------------------------


def is_schedulefree_available() -> bool:
    """``schedulefree`` (Facebook Research's schedule-free optimizers) is installed."""
    return _is_package_available("schedulefree")


def is_pytest_available() -> bool:
    """``pytest`` is installed."""
    return _is_package_available("pytest")


def is_tensorboard_available() -> bool:
    """``tensorboard`` or ``tensorboardX`` is installed."""
    return _is_package_available("tensorboard") or _is_package_available("tensorboardX")


def is_wandb_available() -> bool:
    """``wandb`` is installed."""
    return _is_package_available("wandb")


def is_comet_ml_available() -> bool:
    """``comet_ml`` is installed."""
    return _is_package_available("comet_ml")


def is_mlflow_available() -> bool:
    """``mlflow`` or ``mlflow-skinny`` is installed."""
    return _is_package_available("mlflow") or _is_package_available("mlflow", "mlflow-skinny")


def is_clearml_available() -> bool:
    """``clearml`` is installed."""
    return _is_package_available("clearml")


def is_dvclive_available() -> bool:
    """``dvclive`` is installed."""
    return _is_package_available("dvclive")


def is_swanlab_available() -> bool:
    """``swanlab`` is installed."""
    return _is_package_available("swanlab")


def is_trackio_available() -> bool:
    """``trackio`` is installed."""
    return _is_package_available("trackio")


def is_transformers_available() -> bool:
    """``transformers`` is installed."""
    return _is_package_available("transformers")


def is_datasets_available() -> bool:
    """``datasets`` is installed."""
    return _is_package_available("datasets")


def is_peft_available() -> bool:
    """``peft`` is installed."""
    return _is_package_available("peft")


def is_timm_available() -> bool:
    """``timm`` is installed."""
    return _is_package_available("timm")


def is_torchvision_available() -> bool:
    """``torchvision`` is installed."""
    return _is_package_available("torchvision")


def is_tqdm_available() -> bool:
    """``tqdm`` is installed."""
    return _is_package_available("tqdm")


def is_rich_available() -> bool:
    """``rich`` is installed (Accelerate also requires ``ACCELERATE_ENABLE_RICH``; kwplug has
    no rich integration, so only the package counts)."""
    return _is_package_available("rich")


def is_pandas_available() -> bool:
    """``pandas`` is installed."""
    return _is_package_available("pandas")


def is_matplotlib_available() -> bool:
    """``matplotlib`` is installed."""
    return _is_package_available("matplotlib")


def is_boto3_available() -> bool:
    """``boto3`` is installed."""
    return _is_package_available("boto3")


def is_deepspeed_available() -> bool:
    """``deepspeed`` is installed (kwplug has no DeepSpeed integration)."""
    return _is_package_available("deepspeed")


def is_torchdata_available() -> bool:
    """``torchdata`` is installed."""
    return _is_package_available("torchdata")


def is_torchdata_stateful_dataloader_available() -> bool:
    """``torchdata`` >= 0.8.0 (which has ``StatefulDataLoader``) is installed."""
    return is_torchdata_available() and compare_versions("torchdata", ">=", "0.8.0")


# -- devices ----------------------------------------------------------------------------------


def is_cuda_available() -> bool:
    """``torch.cuda.is_available()`` through NVML, so the check does not initialise CUDA
    (a process can still fork afterwards)."""
    with patch_environment(PYTORCH_NVML_BASED_CUDA_CHECK="1"):
        return bool(torch.cuda.is_available())


def is_mps_available(min_version: str = "1.12") -> bool:
    """Apple's MPS backend is built and available, with torch >= ``min_version``."""
    return (
        is_torch_version(">=", min_version)
        and torch.backends.mps.is_available()
        and torch.backends.mps.is_built()
    )


def is_xpu_available(check_device: bool = False) -> bool:
    """Intel XPU through stock torch (>= 2.7, as Accelerate requires).

    Args:
        check_device: also count the devices (``False`` trusts ``torch.xpu.is_available``).
    """
    if is_torch_version("<", "2.7") or not hasattr(torch, "xpu"):
        return False
    if check_device:
        try:
            torch.xpu.device_count()
        except RuntimeError:
            return False
    return bool(torch.xpu.is_available())


@functools.cache
def _extension_device(module: str, device: str, check_device: bool) -> bool:
    # Out-of-tree backends register torch.<device> when their package is imported.
    if importlib.util.find_spec(module) is None:
        return False
    try:
        importlib.import_module(module)
    except Exception:  # e.g. torch_npu installed in a CPU-only container
        return False
    backend = getattr(torch, device, None)
    if backend is None:
        return False
    try:
        if check_device:
            backend.device_count()
        return bool(backend.is_available())
    except RuntimeError:
        return False


def is_npu_available(check_device: bool = False) -> bool:
    """Huawei Ascend NPU (``torch_npu`` installed and a device present)."""
    return _extension_device("torch_npu", "npu", check_device)


def is_mlu_available(check_device: bool = False) -> bool:
    """Cambricon MLU (``torch_mlu``)."""
    return _extension_device("torch_mlu", "mlu", check_device)


def is_musa_available(check_device: bool = False) -> bool:
    """Moore Threads MUSA (``torch_musa``)."""
    return _extension_device("torch_musa", "musa", check_device)


def is_sdaa_available(check_device: bool = False) -> bool:
    """Tecorigin SDAA (``torch_sdaa``)."""
    return _extension_device("torch_sdaa", "sdaa", check_device)


def is_neuron_available(check_device: bool = False) -> bool:
    """AWS Neuron (``torch_neuronx``)."""
    return _extension_device("torch_neuronx", "neuron", check_device)


def is_hpu_available(init_hccl: bool = False) -> bool:
    """Intel Gaudi HPU (``habana_frameworks.torch``).

    Args:
        init_hccl: also import Habana's HCCL distributed backend.
    """
    if importlib.util.find_spec("habana_frameworks") is None:
        return False
    if not _extension_device("habana_frameworks.torch", "hpu", False):
        return False
    if init_hccl:
        importlib.import_module("habana_frameworks.torch.distributed.hccl")
    return True


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """``torch_xla`` is installed. kwplug has no XLA integration, so it never trains on XLA;
    the device kind is only checked when asked.

    Raises:
        ValueError: both ``check_is_tpu`` and ``check_is_gpu``.
    """
    if check_is_tpu and check_is_gpu:
        raise ValueError("check_is_tpu and check_is_gpu cannot both be True")
    if not _is_package_available("torch_xla", "torch-xla"):
        return False
    if not (check_is_tpu or check_is_gpu):
        return True
    runtime = importlib.import_module("torch_xla.runtime")
    kind = runtime.device_type()
    return kind == "TPU" if check_is_tpu else kind in ("GPU", "CUDA")


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """bfloat16 is supported by the available accelerator (always on the CPU).

    Args:
        ignore_tpu: answer ``False`` on a TPU (as Accelerate).
    """
    if is_torch_xla_available(check_is_tpu=True):
        return not ignore_tpu
    if is_cuda_available():
        return bool(torch.cuda.is_bf16_supported())
    if is_xpu_available():
        return bool(torch.xpu.is_bf16_supported())
    if is_mps_available():
        return bool(torch.backends.mps.is_macos_or_newer(14, 0))
    return True


def is_fp16_available() -> bool:
    """float16 is supported (everywhere but Gaudi 1, which kwplug does not detect)."""
    return True

"""The rest of Accelerate's ``is_*_available`` checks: runtimes, profilers and integrations
kwplug itself does not use, for scripts that branch on them. Package checks look the package
up without importing it (as :mod:`kwplug.utils.imports`)."""

from __future__ import annotations

from typing import Any

import torch

from kwplug.utils.imports import _is_package_available, is_hpu_available

__all__ = [
    "is_aim_available",
    "is_amdsmi_available",
    "is_habana_gaudi1",
    "is_import_timer_available",
    "is_lomo_available",
    "is_peft_model",
    "is_pippy_available",
    "is_pynvml_available",
    "is_rocm_available",
    "is_sagemaker_available",
    "is_triton_available",
    "is_weights_only_available",
    "is_xccl_available",
]


def is_aim_available() -> bool:
    """``aim`` (Aim's experiment tracker) is installed."""
    return _is_package_available("aim")


def is_amdsmi_available() -> bool:
    """``amdsmi`` (AMD's system management interface) is installed."""
    return _is_package_available("amdsmi")


def is_pynvml_available() -> bool:
    """``pynvml`` (NVIDIA's management library bindings) is installed."""
    return _is_package_available("pynvml", "nvidia-ml-py") or _is_package_available("pynvml")


def is_import_timer_available() -> bool:
    """``import_timer`` is installed."""
    return _is_package_available("import_timer")


def is_lomo_available() -> bool:
    """``lomo_optim`` (the LOMO optimizers) is installed."""
    return _is_package_available("lomo_optim")


def is_pippy_available() -> bool:
    """torch's pipeline parallelism (``torch.distributed.pipelining``) is available."""
    try:
        import torch.distributed.pipelining  # noqa: F401
    except ImportError:
        return False
    return True


def is_triton_available() -> bool:
    """``triton`` is installed."""
    return _is_package_available("triton")


def is_rocm_available() -> bool:
    """torch is a ROCm (HIP) build and sees a GPU."""
    return torch.version.hip is not None and torch.cuda.is_available()


def is_weights_only_available() -> bool:
    """``torch.load(weights_only=True)`` with an allow-list exists: always ``True`` on the
    torch versions kwplug supports (2.4 and later)."""
    return hasattr(torch.serialization, "add_safe_globals")


def is_xccl_available() -> bool:
    """torch's XCCL backend (Intel GPUs) is built in."""
    check = getattr(torch.distributed.distributed_c10d, "is_xccl_available", None)
    return bool(check()) if callable(check) else False


def is_habana_gaudi1() -> bool:
    """The HPU is a first-generation Gaudi (needs ``habana_frameworks``)."""
    if not is_hpu_available():
        return False
    import habana_frameworks.torch.utils.experimental as htexp  # type: ignore[import-not-found]

    return bool(htexp._get_device_type() == htexp.synDeviceType.synDeviceGaudi)


def is_sagemaker_available() -> bool:
    """``sagemaker`` (Amazon SageMaker's SDK) is installed."""
    return _is_package_available("sagemaker")


def is_peft_model(model: Any) -> bool:
    """``model``, unwrapped (:func:`~kwplug.utils.extract_model_from_parallel`), is a
    ``peft.PeftModel``. peft is never imported for this: a PeftModel exists only once it is."""
    import sys

    from kwplug.utils.other import extract_model_from_parallel

    kind = getattr(sys.modules.get("peft"), "PeftModel", None)
    if not isinstance(kind, type) or not isinstance(model, torch.nn.Module):
        return False
    return isinstance(extract_model_from_parallel(model), kind)

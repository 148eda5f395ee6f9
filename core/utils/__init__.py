"""What training scripts import from ``accelerate.utils``, under the same names.

``from accelerate.utils import set_seed, DistributedType`` ports as
``from kwplug.utils import set_seed, DistributedType``. Every name is loaded on first use:
importing this package imports none of its modules (nor NumPy or Accelerate).

Modules, named as Accelerate's:

- :mod:`kwplug.utils.dataclasses`: ``DistributedType``, ``DataLoaderConfiguration``,
  ``ProjectConfiguration``, ``GradientAccumulationPlugin``;
- :mod:`kwplug.utils.random`: ``set_seed``;
- :mod:`kwplug.utils.memory`: ``find_executable_batch_size``, ``release_memory``...;
- :mod:`kwplug.utils.operations`: ``gather``, ``gather_object``, ``reduce``, ``broadcast``,
  ``broadcast_object_list``, ``pad_across_processes``;
- :mod:`kwplug.utils.structures`: ``send_to_device``, ``recursively_apply`` and other helpers
  for nested tuples/lists/dicts of tensors (in Accelerate's ``operations``);
- :mod:`kwplug.utils.imports`: ``is_*_available``, ``is_torch_version``;
- :mod:`kwplug.utils.environment`: ``patch_environment``, ``str_to_bool``;
- the handlers (``AutocastKwargs``, ``DistributedDataParallelKwargs``, ``GradScalerKwargs``,
  ``InitProcessGroupKwargs``, ``ProfileKwargs``) and ``DDPCommunicationHookType``, from
  :mod:`kwplug.plugins`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kwplug.plugins import (
        AutocastKwargs,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ProfileKwargs,
    )
    from kwplug.utils.dataclasses import (
        DataLoaderConfiguration,
        DistributedType,
        GradientAccumulationPlugin,
        ProjectConfiguration,
    )
    from kwplug.utils.environment import parse_flag_from_env, patch_environment, str_to_bool
    from kwplug.utils.imports import (
        compare_versions,
        is_bf16_available,
        is_boto3_available,
        is_clearml_available,
        is_comet_ml_available,
        is_cuda_available,
        is_datasets_available,
        is_deepspeed_available,
        is_dvclive_available,
        is_fp16_available,
        is_hpu_available,
        is_matplotlib_available,
        is_mlflow_available,
        is_mlu_available,
        is_mps_available,
        is_musa_available,
        is_neuron_available,
        is_npu_available,
        is_pandas_available,
        is_peft_available,
        is_rich_available,
        is_schedulefree_available,
        is_sdaa_available,
        is_swanlab_available,
        is_tensorboard_available,
        is_timm_available,
        is_torch_distributed_available,
        is_torch_version,
        is_torch_xla_available,
        is_torchdata_available,
        is_torchdata_stateful_dataloader_available,
        is_torchvision_available,
        is_tqdm_available,
        is_trackio_available,
        is_transformers_available,
        is_wandb_available,
        is_xpu_available,
    )
    from kwplug.utils.memory import (
        clear_device_cache,
        find_executable_batch_size,
        release_memory,
        should_reduce_batch_size,
    )
    from kwplug.utils.operations import (
        CannotPadNestedTensorWarning,
        DistributedOperationException,
        broadcast,
        broadcast_object_list,
        gather,
        gather_object,
        pad_across_processes,
        reduce,
    )
    from kwplug.utils.random import set_seed
    from kwplug.utils.structures import (
        concatenate,
        convert_to_fp32,
        find_batch_size,
        find_device,
        get_shape,
        honor_type,
        ignorant_find_batch_size,
        is_namedtuple,
        is_torch_tensor,
        listify,
        recursively_apply,
        send_to_device,
        slice_tensors,
    )

#: Module that defines each exported name (Accelerate's names only: a module may define more).
_MODULES: dict[str, tuple[str, ...]] = {
    "kwplug.plugins": (
        "AutocastKwargs",
        "DDPCommunicationHookType",
        "DistributedDataParallelKwargs",
        "GradScalerKwargs",
        "InitProcessGroupKwargs",
        "ProfileKwargs",
    ),
    "kwplug.utils.dataclasses": (
        "DataLoaderConfiguration",
        "DistributedType",
        "GradientAccumulationPlugin",
        "ProjectConfiguration",
    ),
    "kwplug.utils.environment": ("parse_flag_from_env", "patch_environment", "str_to_bool"),
    "kwplug.utils.imports": (
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
    ),
    "kwplug.utils.memory": (
        "clear_device_cache",
        "find_executable_batch_size",
        "release_memory",
        "should_reduce_batch_size",
    ),
    "kwplug.utils.operations": (
        "CannotPadNestedTensorWarning",
        "DistributedOperationException",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "pad_across_processes",
        "reduce",
    ),
    "kwplug.utils.random": ("set_seed",),
    "kwplug.utils.structures": (
        "concatenate",
        "convert_to_fp32",
        "find_batch_size",
        "find_device",
        "get_shape",
        "honor_type",
        "ignorant_find_batch_size",
        "is_namedtuple",
        "is_torch_tensor",
        "listify",
        "recursively_apply",
        "send_to_device",
        "slice_tensors",
    ),
}

_WHERE = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "AutocastKwargs",
    "CannotPadNestedTensorWarning",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedOperationException",
    "DistributedType",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "ProfileKwargs",
    "ProjectConfiguration",
    "broadcast",
    "broadcast_object_list",
    "clear_device_cache",
    "compare_versions",
    "concatenate",
    "convert_to_fp32",
    "find_batch_size",
    "find_device",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "get_shape",
    "honor_type",
    "ignorant_find_batch_size",
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
    "is_namedtuple",
    "is_neuron_available",
    "is_npu_available",
    "is_pandas_available",
    "is_peft_available",
    "is_rich_available",
    "is_schedulefree_available",
    "is_sdaa_available",
    "is_swanlab_available",
    "is_tensorboard_available",
    "is_timm_available",
    "is_torch_distributed_available",
    "is_torch_tensor",
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
    "listify",
    "pad_across_processes",
    "parse_flag_from_env",
    "patch_environment",
    "recursively_apply",
    "reduce",
    "release_memory",
    "send_to_device",
    "set_seed",
    "should_reduce_batch_size",
    "slice_tensors",
    "str_to_bool",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kwplug.utils' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})

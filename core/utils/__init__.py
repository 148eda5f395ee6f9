"""What training scripts import from ``accelerate.utils``, under the same names.

``from accelerate.utils import set_seed, DistributedType`` ports as
``from kwplug.utils import set_seed, DistributedType``. Every name is loaded on first use:
importing this package imports none of its modules (nor NumPy or Accelerate).

Modules, named as Accelerate's:

- :mod:`kwplug.utils.dataclasses`: ``DistributedType``, ``RNGType``,
  ``DataLoaderConfiguration``, ``ProjectConfiguration``, ``GradientAccumulationPlugin``;
- :mod:`kwplug.utils.random`: ``set_seed``, ``synchronize_rng_states``;
- :mod:`kwplug.utils.memory`: ``find_executable_batch_size``, ``release_memory``...;
- :mod:`kwplug.utils.operations`: ``gather``, ``gather_object``, ``reduce``, ``broadcast``,
  ``broadcast_object_list``, ``copy_tensor_to_devices``, ``pad_across_processes``;
- :mod:`kwplug.utils.structures`: ``send_to_device``, ``recursively_apply`` and other helpers
  for nested tuples/lists/dicts of tensors (in Accelerate's ``operations``);
- :mod:`kwplug.utils.imports`: ``is_*_available``, ``is_torch_version``
  (:mod:`kwplug.utils.availability`: the checks for integrations kwplug does not use);
- :mod:`kwplug.utils.devices`: ``get_torch_accelerator_backend``, ``get_distributed_backend``,
  ``normalize_device``, ``get_accelerator_free_memory``;
- :mod:`kwplug.utils.other`: ``wait_for_everyone``, ``extract_model_from_parallel``;
  :mod:`kwplug.utils.progress`: ``tqdm``;
- :mod:`kwplug.utils.environment`: ``patch_environment``, ``clear_environment``,
  ``purge_accelerate_environment``, ``str_to_bool``;
- ``KwargsHandler`` (:mod:`kwplug.handler`; ``@attrs.define`` or ``@dataclass`` subclasses);
- the handlers (``AutocastKwargs``, ``DistributedDataParallelKwargs``, ``GradScalerKwargs``,
  ``InitProcessGroupKwargs``, ``ProfileKwargs``, ``TorchDynamoPlugin``),
  ``DDPCommunicationHookType`` and ``DynamoBackend``, from :mod:`kwplug.plugins`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kwplug._contracts.lazy import BUILTIN_HANDLERS, exporter

if TYPE_CHECKING:  # the same names, for type checkers (explicit re-exports)
    from kwplug.handler import KwargsHandler as KwargsHandler
    from kwplug.plugins import AutocastKwargs as AutocastKwargs
    from kwplug.plugins import DDPCommunicationHookType as DDPCommunicationHookType
    from kwplug.plugins import DistributedDataParallelKwargs as DistributedDataParallelKwargs
    from kwplug.plugins import DynamoBackend as DynamoBackend
    from kwplug.plugins import FullyShardedDataParallelPlugin as FullyShardedDataParallelPlugin
    from kwplug.plugins import GradScalerKwargs as GradScalerKwargs
    from kwplug.plugins import InitProcessGroupKwargs as InitProcessGroupKwargs
    from kwplug.plugins import ParallelismConfig as ParallelismConfig
    from kwplug.plugins import ProfileKwargs as ProfileKwargs
    from kwplug.plugins import TorchDynamoPlugin as TorchDynamoPlugin
    from kwplug.utils.availability import is_aim_available as is_aim_available
    from kwplug.utils.availability import is_amdsmi_available as is_amdsmi_available
    from kwplug.utils.availability import is_habana_gaudi1 as is_habana_gaudi1
    from kwplug.utils.availability import is_import_timer_available as is_import_timer_available
    from kwplug.utils.availability import is_lomo_available as is_lomo_available
    from kwplug.utils.availability import is_peft_model as is_peft_model
    from kwplug.utils.availability import is_pippy_available as is_pippy_available
    from kwplug.utils.availability import is_pynvml_available as is_pynvml_available
    from kwplug.utils.availability import is_rocm_available as is_rocm_available
    from kwplug.utils.availability import is_sagemaker_available as is_sagemaker_available
    from kwplug.utils.availability import is_triton_available as is_triton_available
    from kwplug.utils.availability import is_weights_only_available as is_weights_only_available
    from kwplug.utils.availability import is_xccl_available as is_xccl_available
    from kwplug.utils.dataclasses import AORecipeKwargs as AORecipeKwargs
    from kwplug.utils.dataclasses import DataLoaderConfiguration as DataLoaderConfiguration
    from kwplug.utils.dataclasses import DistributedType as DistributedType
    from kwplug.utils.dataclasses import GradientAccumulationPlugin as GradientAccumulationPlugin
    from kwplug.utils.dataclasses import ProjectConfiguration as ProjectConfiguration
    from kwplug.utils.dataclasses import RNGType as RNGType
    from kwplug.utils.dataclasses import TERecipeKwargs as TERecipeKwargs
    from kwplug.utils.devices import get_accelerator_free_memory as get_accelerator_free_memory
    from kwplug.utils.devices import get_distributed_backend as get_distributed_backend
    from kwplug.utils.devices import get_torch_accelerator_backend as get_torch_accelerator_backend
    from kwplug.utils.devices import normalize_device as normalize_device
    from kwplug.utils.environment import clear_environment as clear_environment
    from kwplug.utils.environment import (
        convert_dict_to_env_variables as convert_dict_to_env_variables,
    )
    from kwplug.utils.environment import parse_flag_from_env as parse_flag_from_env
    from kwplug.utils.environment import patch_environment as patch_environment
    from kwplug.utils.environment import (
        purge_accelerate_environment as purge_accelerate_environment,
    )
    from kwplug.utils.environment import str_to_bool as str_to_bool
    from kwplug.utils.imports import compare_versions as compare_versions
    from kwplug.utils.imports import is_bf16_available as is_bf16_available
    from kwplug.utils.imports import is_boto3_available as is_boto3_available
    from kwplug.utils.imports import is_clearml_available as is_clearml_available
    from kwplug.utils.imports import is_comet_ml_available as is_comet_ml_available
    from kwplug.utils.imports import is_cuda_available as is_cuda_available
    from kwplug.utils.imports import is_datasets_available as is_datasets_available
    from kwplug.utils.imports import is_deepspeed_available as is_deepspeed_available
    from kwplug.utils.imports import is_dvclive_available as is_dvclive_available
    from kwplug.utils.imports import is_fp16_available as is_fp16_available
    from kwplug.utils.imports import is_hpu_available as is_hpu_available
    from kwplug.utils.imports import is_matplotlib_available as is_matplotlib_available
    from kwplug.utils.imports import is_mlflow_available as is_mlflow_available
    from kwplug.utils.imports import is_mlu_available as is_mlu_available
    from kwplug.utils.imports import is_mps_available as is_mps_available
    from kwplug.utils.imports import is_musa_available as is_musa_available
    from kwplug.utils.imports import is_neuron_available as is_neuron_available
    from kwplug.utils.imports import is_npu_available as is_npu_available
    from kwplug.utils.imports import is_pandas_available as is_pandas_available
    from kwplug.utils.imports import is_peft_available as is_peft_available
    from kwplug.utils.imports import is_pytest_available as is_pytest_available
    from kwplug.utils.imports import is_rich_available as is_rich_available
    from kwplug.utils.imports import is_schedulefree_available as is_schedulefree_available
    from kwplug.utils.imports import is_sdaa_available as is_sdaa_available
    from kwplug.utils.imports import is_swanlab_available as is_swanlab_available
    from kwplug.utils.imports import is_tensorboard_available as is_tensorboard_available
    from kwplug.utils.imports import is_timm_available as is_timm_available
    from kwplug.utils.imports import (
        is_torch_distributed_available as is_torch_distributed_available,
    )
    from kwplug.utils.imports import is_torch_version as is_torch_version
    from kwplug.utils.imports import is_torch_xla_available as is_torch_xla_available
    from kwplug.utils.imports import is_torchdata_available as is_torchdata_available
    from kwplug.utils.imports import (
        is_torchdata_stateful_dataloader_available as is_torchdata_stateful_dataloader_available,
    )
    from kwplug.utils.imports import is_torchvision_available as is_torchvision_available
    from kwplug.utils.imports import is_tqdm_available as is_tqdm_available
    from kwplug.utils.imports import is_trackio_available as is_trackio_available
    from kwplug.utils.imports import is_transformers_available as is_transformers_available
    from kwplug.utils.imports import is_wandb_available as is_wandb_available
    from kwplug.utils.imports import is_xpu_available as is_xpu_available
    from kwplug.utils.memory import clear_device_cache as clear_device_cache
    from kwplug.utils.memory import find_executable_batch_size as find_executable_batch_size
    from kwplug.utils.memory import release_memory as release_memory
    from kwplug.utils.memory import should_reduce_batch_size as should_reduce_batch_size
    from kwplug.utils.modeling import has_offloaded_params as has_offloaded_params
    from kwplug.utils.operations import CannotPadNestedTensorWarning as CannotPadNestedTensorWarning
    from kwplug.utils.operations import (
        DistributedOperationException as DistributedOperationException,
    )
    from kwplug.utils.operations import broadcast as broadcast
    from kwplug.utils.operations import broadcast_object_list as broadcast_object_list
    from kwplug.utils.operations import copy_tensor_to_devices as copy_tensor_to_devices
    from kwplug.utils.operations import gather as gather
    from kwplug.utils.operations import gather_object as gather_object
    from kwplug.utils.operations import pad_across_processes as pad_across_processes
    from kwplug.utils.operations import reduce as reduce
    from kwplug.utils.other import check_os_kernel as check_os_kernel
    from kwplug.utils.other import extract_model_from_parallel as extract_model_from_parallel
    from kwplug.utils.other import get_model_tp_size as get_model_tp_size
    from kwplug.utils.other import model_has_dtensor as model_has_dtensor
    from kwplug.utils.other import save as save
    from kwplug.utils.other import wait_for_everyone as wait_for_everyone
    from kwplug.utils.progress import tqdm as tqdm
    from kwplug.utils.random import set_seed as set_seed
    from kwplug.utils.random import synchronize_rng_state as synchronize_rng_state
    from kwplug.utils.random import synchronize_rng_states as synchronize_rng_states
    from kwplug.utils.structures import concatenate as concatenate
    from kwplug.utils.structures import convert_outputs_to_fp32 as convert_outputs_to_fp32
    from kwplug.utils.structures import convert_to_fp32 as convert_to_fp32
    from kwplug.utils.structures import find_batch_size as find_batch_size
    from kwplug.utils.structures import find_device as find_device
    from kwplug.utils.structures import get_shape as get_shape
    from kwplug.utils.structures import honor_type as honor_type
    from kwplug.utils.structures import ignorant_find_batch_size as ignorant_find_batch_size
    from kwplug.utils.structures import is_namedtuple as is_namedtuple
    from kwplug.utils.structures import is_torch_tensor as is_torch_tensor
    from kwplug.utils.structures import listify as listify
    from kwplug.utils.structures import pad_input_tensors as pad_input_tensors
    from kwplug.utils.structures import recursively_apply as recursively_apply
    from kwplug.utils.structures import send_to_device as send_to_device
    from kwplug.utils.structures import slice_tensors as slice_tensors

#: Public name -> the module that defines it (Accelerate's names only: a module may define
#: more). The one list of this package's names: ``__all__`` and ``dir()`` derive from it.
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(BUILTIN_HANDLERS, "kwplug.plugins"),
    "DDPCommunicationHookType": "kwplug.plugins",
    "DynamoBackend": "kwplug.plugins",
    "TorchDynamoPlugin": "kwplug.plugins",
    "FullyShardedDataParallelPlugin": "kwplug.plugins",
    "ParallelismConfig": "kwplug.plugins",
    "DataLoaderConfiguration": "kwplug.utils.dataclasses",
    "AORecipeKwargs": "kwplug.utils.dataclasses",
    "TERecipeKwargs": "kwplug.utils.dataclasses",
    "DistributedType": "kwplug.utils.dataclasses",
    "RNGType": "kwplug.utils.dataclasses",
    "GradientAccumulationPlugin": "kwplug.utils.dataclasses",
    "ProjectConfiguration": "kwplug.utils.dataclasses",
    "KwargsHandler": "kwplug.handler",
    "clear_environment": "kwplug.utils.environment",
    "convert_dict_to_env_variables": "kwplug.utils.environment",
    "parse_flag_from_env": "kwplug.utils.environment",
    "patch_environment": "kwplug.utils.environment",
    "purge_accelerate_environment": "kwplug.utils.environment",
    "str_to_bool": "kwplug.utils.environment",
    "compare_versions": "kwplug.utils.imports",
    "is_bf16_available": "kwplug.utils.imports",
    "is_boto3_available": "kwplug.utils.imports",
    "is_clearml_available": "kwplug.utils.imports",
    "is_comet_ml_available": "kwplug.utils.imports",
    "is_cuda_available": "kwplug.utils.imports",
    "is_datasets_available": "kwplug.utils.imports",
    "is_deepspeed_available": "kwplug.utils.imports",
    "is_dvclive_available": "kwplug.utils.imports",
    "is_fp16_available": "kwplug.utils.imports",
    "is_hpu_available": "kwplug.utils.imports",
    "is_matplotlib_available": "kwplug.utils.imports",
    "is_mlflow_available": "kwplug.utils.imports",
    "is_mlu_available": "kwplug.utils.imports",
    "is_mps_available": "kwplug.utils.imports",
    "is_musa_available": "kwplug.utils.imports",
    "is_neuron_available": "kwplug.utils.imports",
    "is_npu_available": "kwplug.utils.imports",
    "is_pandas_available": "kwplug.utils.imports",
    "is_peft_available": "kwplug.utils.imports",
    "is_rich_available": "kwplug.utils.imports",
    "is_schedulefree_available": "kwplug.utils.imports",
    "is_sdaa_available": "kwplug.utils.imports",
    "is_swanlab_available": "kwplug.utils.imports",
    "is_tensorboard_available": "kwplug.utils.imports",
    "is_pytest_available": "kwplug.utils.imports",
    "is_timm_available": "kwplug.utils.imports",
    "is_torch_distributed_available": "kwplug.utils.imports",
    "is_torch_version": "kwplug.utils.imports",
    "is_torch_xla_available": "kwplug.utils.imports",
    "is_torchdata_available": "kwplug.utils.imports",
    "is_torchdata_stateful_dataloader_available": "kwplug.utils.imports",
    "is_torchvision_available": "kwplug.utils.imports",
    "is_tqdm_available": "kwplug.utils.imports",
    "is_trackio_available": "kwplug.utils.imports",
    "is_transformers_available": "kwplug.utils.imports",
    "is_wandb_available": "kwplug.utils.imports",
    "is_xpu_available": "kwplug.utils.imports",
    "clear_device_cache": "kwplug.utils.memory",
    "find_executable_batch_size": "kwplug.utils.memory",
    "release_memory": "kwplug.utils.memory",
    "should_reduce_batch_size": "kwplug.utils.memory",
    "CannotPadNestedTensorWarning": "kwplug.utils.operations",
    "DistributedOperationException": "kwplug.utils.operations",
    "broadcast": "kwplug.utils.operations",
    "broadcast_object_list": "kwplug.utils.operations",
    "copy_tensor_to_devices": "kwplug.utils.operations",
    "gather": "kwplug.utils.operations",
    "gather_object": "kwplug.utils.operations",
    "pad_across_processes": "kwplug.utils.operations",
    "reduce": "kwplug.utils.operations",
    "set_seed": "kwplug.utils.random",
    "is_aim_available": "kwplug.utils.availability",
    "is_amdsmi_available": "kwplug.utils.availability",
    "is_habana_gaudi1": "kwplug.utils.availability",
    "is_import_timer_available": "kwplug.utils.availability",
    "is_lomo_available": "kwplug.utils.availability",
    "is_peft_model": "kwplug.utils.availability",
    "is_pippy_available": "kwplug.utils.availability",
    "is_pynvml_available": "kwplug.utils.availability",
    "is_rocm_available": "kwplug.utils.availability",
    "is_sagemaker_available": "kwplug.utils.availability",
    "is_triton_available": "kwplug.utils.availability",
    "is_weights_only_available": "kwplug.utils.availability",
    "is_xccl_available": "kwplug.utils.availability",
    "get_accelerator_free_memory": "kwplug.utils.devices",
    "get_distributed_backend": "kwplug.utils.devices",
    "get_torch_accelerator_backend": "kwplug.utils.devices",
    "normalize_device": "kwplug.utils.devices",
    "check_os_kernel": "kwplug.utils.other",
    "extract_model_from_parallel": "kwplug.utils.other",
    "get_model_tp_size": "kwplug.utils.other",
    "model_has_dtensor": "kwplug.utils.other",
    "save": "kwplug.utils.other",
    "wait_for_everyone": "kwplug.utils.other",
    "tqdm": "kwplug.utils.progress",
    "synchronize_rng_state": "kwplug.utils.random",
    "synchronize_rng_states": "kwplug.utils.random",
    "concatenate": "kwplug.utils.structures",
    "convert_outputs_to_fp32": "kwplug.utils.structures",
    "pad_input_tensors": "kwplug.utils.structures",
    "has_offloaded_params": "kwplug.utils.modeling",
    "convert_to_fp32": "kwplug.utils.structures",
    "find_batch_size": "kwplug.utils.structures",
    "find_device": "kwplug.utils.structures",
    "get_shape": "kwplug.utils.structures",
    "honor_type": "kwplug.utils.structures",
    "ignorant_find_batch_size": "kwplug.utils.structures",
    "is_namedtuple": "kwplug.utils.structures",
    "is_torch_tensor": "kwplug.utils.structures",
    "listify": "kwplug.utils.structures",
    "recursively_apply": "kwplug.utils.structures",
    "send_to_device": "kwplug.utils.structures",
    "slice_tensors": "kwplug.utils.structures",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = exporter(globals(), _EXPORTS)

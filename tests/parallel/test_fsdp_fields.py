"""FullyShardedDataParallelPlugin and ParallelismConfig as objects: Accelerate 1.16's fields,
environment defaults, and a clear error for what kwplug does not do (one process, no torchrun)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kwplug
from kwplug import FullyShardedDataParallelPlugin, ParallelismConfig


def test_fields_are_accelerates_in_its_order() -> None:
    accelerate = pytest.importorskip("accelerate.utils")
    for ours, theirs in (
        (FullyShardedDataParallelPlugin, accelerate.FullyShardedDataParallelPlugin),
        (ParallelismConfig, accelerate.ParallelismConfig),
    ):
        mine = [f.name for f in __import__("attrs").fields(ours) if f.init]
        assert mine == [f.name for f in dataclasses.fields(theirs) if f.init]


def test_public_import_paths() -> None:
    import kwplug.utils

    assert kwplug.FullyShardedDataParallelPlugin is kwplug.utils.FullyShardedDataParallelPlugin
    assert kwplug.ParallelismConfig is kwplug.utils.ParallelismConfig


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("fsdp_version", 1, "fsdp_version must be 2"),
        ("sharding_strategy", "FULL_SHARD", "sharding_strategy must be None"),
        ("backward_prefetch", "BACKWARD_PRE", "backward_prefetch"),
        ("forward_prefetch", True, "forward_prefetch"),
        ("sync_module_states", True, "cpu_ram_efficient_loading"),
        ("param_init_fn", print, "param_init_fn must be None"),
        ("use_orig_params", False, "use_orig_params"),
        ("auto_wrap_policy", "LAYER_WRAP", "TRANSFORMER_BASED_WRAP"),
        ("state_dict_type", "LOCAL_STATE_DICT", "no LOCAL_STATE_DICT"),
        ("mixed_precision_policy", "fp4", "mixed_precision_policy"),
        ("reshard_after_forward", "SHARD_GRAD_OP", "sharding strategy names"),
        ("min_num_params", -1, ">= 0"),
        ("ignored_modules", "layers.(", "ignored_modules must be a valid regular expression"),
    ],
)
def test_what_kwplug_does_not_do_is_a_value_error(field: str, value: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        FullyShardedDataParallelPlugin(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cpu_offload", "yes"),
        ("mixed_precision_policy", 16),
        ("activation_checkpointing", 1),
        ("transformer_cls_names_to_wrap", [torch.nn.Linear]),
        ("state_dict_config", {"offload_to_cpu": True}),
        ("ignored_modules", [3]),
    ],
)
def test_wrong_types_are_type_errors_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(TypeError, match=f"FullyShardedDataParallelPlugin.{field}"):
        FullyShardedDataParallelPlugin(**{field: value})  # type: ignore[arg-type]


def test_values_are_normalised_as_accelerate_does() -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    plugin = FullyShardedDataParallelPlugin(
        reshard_after_forward="false",
        mixed_precision_policy="bf16",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap="Block,Head",
        cpu_offload=True,
        state_dict_type="full_state_dict",
    )
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is False
    assert plugin.mixed_precision_policy == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16
    )
    assert plugin.auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
    assert plugin.transformer_cls_names_to_wrap == ["Block", "Head"]
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    assert plugin.state_dict_type == "FULL_STATE_DICT"
    assert plugin.state_dict_config.rank0_only and plugin.state_dict_config.offload_to_cpu
    sized = FullyShardedDataParallelPlugin(auto_wrap_policy=size_based_auto_wrap_policy)
    assert sized.auto_wrap_policy == "SIZE_BASED_WRAP" and sized.min_num_params == 0
    mixed = {"param_dtype": torch.float16, "reduce_dtype": torch.float32}
    assert FullyShardedDataParallelPlugin(mixed_precision_policy=mixed).mixed_precision_policy == (
        MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    )


def test_accelerates_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP")
    monkeypatch.setenv("FSDP_MIN_NUM_PARAMS", "1000")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.auto_wrap_policy == "SIZE_BASED_WRAP" and plugin.min_num_params == 1000
    assert plugin.reshard_after_forward is False and plugin.activation_checkpointing is True
    assert plugin.state_dict_type == "FULL_STATE_DICT"
    monkeypatch.setenv("FSDP_MIN_NUM_PARAMS", "1e6")  # int()'s message named no field
    with pytest.raises(ValueError, match=r"min_num_params \(from FSDP_MIN_NUM_PARAMS\)"):
        FullyShardedDataParallelPlugin()
    monkeypatch.setenv("FSDP_MIN_NUM_PARAMS", "1000")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match="fsdp_version must be 2"):
        FullyShardedDataParallelPlugin()


def test_activation_checkpointing_offload_needs_activation_checkpointing() -> None:
    with pytest.raises(ValueError, match="requires activation_checkpointing=True"):
        FullyShardedDataParallelPlugin(activation_checkpointing_offload=True)


def test_parallelism_config_errors_at_construction() -> None:
    with pytest.raises(ValueError, match="context parallelism"):
        ParallelismConfig(cp_size=2)
    with pytest.raises(ValueError, match="DeepSpeed"):
        ParallelismConfig(sp_size=2)
    with pytest.raises(ValueError, match="at least 1"):
        ParallelismConfig(dp_shard_size=0)
    with pytest.raises(TypeError, match="tp_size must be an int"):
        ParallelismConfig(tp_size=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown style 'diagonal'"):
        ParallelismConfig(tp_size=2, tp_handler={"fc": "diagonal"})
    with pytest.raises(ValueError, match="cp_backend must be 'torch', got 'nccl'"):
        ParallelismConfig(cp_backend="nccl")  # the message named cp_size (got 1)
    # Sizes that do not fill the processes: refused in Accelerator(), before any collective.
    with pytest.raises(ValueError, match=r"total_size \(2 = .*\) does not match .*\(1\)"):
        kwplug.Accelerator(parallelism_config=ParallelismConfig(tp_size=2))


def test_parallelism_config_names_are_accelerates() -> None:
    accelerate = pytest.importorskip("accelerate.utils")
    # Accelerate's tp_size > 1 needs transformers (its TorchTensorParallelConfig): dp only.
    for sizes in ({"dp_shard_size": 4}, {"dp_replicate_size": 2, "dp_shard_size": 2}):
        ours, theirs = ParallelismConfig(**sizes), accelerate.ParallelismConfig(**sizes)
        for name in ("dp_dim_names", "non_dp_dim_names", "dp_shard_cp_dim_names",
                     "dp_cp_dim_names", "fsdp_dim_names", "total_size", "data_parallel_size",
                     "non_data_parallel_size", "active_mesh_dims"):  # fmt: skip
            assert getattr(ours, name) == getattr(theirs, name), (sizes, name)
        assert ours._sizes == {k: v for k, v in theirs._sizes.items()}


def test_plugin_keywords_take_kwplug_handlers_only() -> None:
    accelerate = pytest.importorskip("accelerate.utils")
    with pytest.raises(TypeError, match="fsdp_plugin must be a kwplug handler"):
        kwplug.Accelerator(fsdp_plugin=accelerate.FullyShardedDataParallelPlugin(fsdp_version=2))


def test_one_process_declines_and_reports_fsdp() -> None:
    accelerator = kwplug.Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    model = torch.nn.Linear(2, 2)
    assert accelerator.prepare(model) is model  # nothing to shard over
    assert accelerator.is_fsdp2 and accelerator.torch_device_mesh is None
    assert accelerator.plan["device_mesh"].plugin is None


def test_a_default_handler_does_not_import_torch_fsdp() -> None:
    # Discovery builds a default instance of every handler class in every process: importing
    # torch.distributed.fsdp there (~1 s) would tax every Accelerator, FSDP or not.
    from python import python

    code = (
        "import sys, torch\n"
        "from kwplug.plugins.fsdp import FullyShardedDataParallelPlugin as F\n"
        "plugin = F()\n"
        "print(plugin.cpu_offload, plugin.mixed_precision_policy, plugin.state_dict_config,\n"
        "      'torch.distributed.fsdp' in sys.modules)\n"
    )
    out = python("-c", code, timeout=120, check=True).stdout.split()
    assert out == ["None", "None", "None", "False"]

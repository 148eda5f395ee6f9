"""The FSDP2 plugin's options and precisions in 2 gloo processes: fp16's scaler skips on
every rank when one shard overflows, bf16 keeps float32 shards, activation checkpointing,
``cpu_ram_efficient_loading``, ``ignored_modules`` and the size-based policy."""

from __future__ import annotations

from typing import Any

import torch
from test_fsdp_mesh import Net
from torch import nn

import kwplug
from kwplug.testing import run_distributed


def low_precision(mixed_precision: str) -> dict[str, Any]:
    """One FSDP2 step under ``mixed_precision``; under fp16 rank 1 alone gets an inf gradient
    in its own shard."""
    from torch.distributed.tensor import DTensor

    from kwplug import FullyShardedDataParallelPlugin

    accelerator = kwplug.Accelerator(
        mixed_precision=mixed_precision, fsdp_plugin=FullyShardedDataParallelPlugin()
    )
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    accelerator.backward(nn.functional.mse_loss(model(x).float(), y))
    grad = model.inp.weight.grad
    assert isinstance(grad, DTensor)
    if mixed_precision == "fp16" and accelerator.process_index == 1:
        grad.to_local().view(-1)[0] = float("inf")
    before = model.inp.weight.to_local().clone()
    optimizer.step()
    policy = model._get_fsdp_state()._mp_policy
    result = {
        "skipped": optimizer.step_was_skipped,
        "changed": not torch.equal(before, model.inp.weight.to_local()),
        "param_dtype": str(model.inp.weight.dtype),
        "policy": (str(policy.param_dtype), str(policy.reduce_dtype)),
        "scaler": type(accelerator.scaler).__name__,
    }
    accelerator.end_training()
    return result


def test_fp16_scaler_skips_on_every_rank_when_one_shard_overflows() -> None:
    ranks = run_distributed(low_precision, "fp16", nproc=2, timeout=120)
    # torch's GradScaler all-reduces found_inf over a DTensor's mesh: no rank steps alone.
    assert [r["skipped"] for r in ranks] == [True, True]
    assert [r["changed"] for r in ranks] == [False, False]
    assert ranks[0]["scaler"] == "GradScaler"
    assert ranks[0]["policy"] == ("torch.float16", "torch.float16")  # Accelerate's default


def test_bf16_keeps_float32_shards_and_accelerates_policy() -> None:
    ranks = run_distributed(low_precision, "bf16", nproc=2, timeout=120)
    assert ranks[0]["param_dtype"] == "torch.float32" and ranks[0]["changed"]
    assert ranks[0]["policy"] == ("torch.bfloat16", "torch.bfloat16")
    assert not ranks[0]["skipped"]


def _one_step(plugin: Any, perturb: bool = False) -> tuple[Any, nn.Module, float]:
    accelerator = kwplug.Accelerator(fsdp_plugin=plugin)
    model = Net()
    if perturb and accelerator.process_index == 1:  # rank 1 starts from other weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(accelerator.process_index))
    loss = model(x).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    return accelerator, model, float(loss)


def features() -> dict[str, Any]:
    """Activation checkpointing, rank-0 weight broadcast, ignored modules, the size policy."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from kwplug import FullyShardedDataParallelPlugin as Plugin

    def full(model: nn.Module) -> dict[str, list[Any]]:
        return {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).tolist()
            for k, v in model.state_dict().items()
        }

    blocks = {
        "auto_wrap_policy": "transformer_based_wrap",
        "transformer_cls_names_to_wrap": "Block",
    }
    acc, plain, plain_loss = _one_step(Plugin(**blocks))
    acc.end_training()
    acc, ac, ac_loss = _one_step(Plugin(activation_checkpointing=True, **blocks))
    checkpointed = type(ac.blocks[0].forward).__name__
    same_after_ac = full(plain) == full(ac)
    acc.end_training()
    acc, loaded, _ = _one_step(Plugin(cpu_ram_efficient_loading=True), perturb=True)
    # One step from rank 0's weights on every rank: the same as the unperturbed run.
    acc.end_training()
    acc, reference, _ = _one_step(Plugin())
    broadcast_ok = full(loaded) == full(reference)
    acc.end_training()
    acc, ignored, _ = _one_step(Plugin(ignored_modules="out"))
    ignored_plain = not isinstance(ignored.out.weight, DTensor)
    others_sharded = isinstance(ignored.inp.weight, DTensor)
    acc.end_training()
    acc, sized, _ = _one_step(Plugin(auto_wrap_policy="size_based_wrap", min_num_params=200))
    own_groups = sorted(n for n, m in sized.named_modules() if isinstance(m, FSDPModule) and n)
    acc.end_training()
    return {
        "ac_loss": ac_loss == plain_loss,
        "checkpointed": checkpointed,
        "same_after_ac": same_after_ac,
        "broadcast_ok": broadcast_ok,
        "ignored_plain": ignored_plain,
        "others_sharded": others_sharded,
        "own_groups": own_groups,
    }


def test_fsdp_plugin_features() -> None:
    for rank in run_distributed(features, nproc=2, timeout=300):
        assert rank["checkpointed"] == "_Checkpointed"
        assert rank["ac_loss"] and rank["same_after_ac"]  # recomputation changes no value
        assert rank["broadcast_ok"]  # cpu_ram_efficient_loading: rank 0's weights everywhere
        assert rank["ignored_plain"] and rank["others_sharded"]
        # Modules with more than 200 parameters (Accelerate's rule: a module's own and its
        # children's): each Block's Linear and the Block (272), their Sequential (544).
        inner = ["blocks.0", "blocks.0.inner", "blocks.1", "blocks.1.inner"]
        assert rank["own_groups"] == ["blocks", *inner]

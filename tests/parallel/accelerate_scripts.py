"""Accelerate's FSDP2/ND-parallel example scripts, adapted to CPU, tiny models and generated
data, with their ``Accelerator``/plugin calls kept as written and only ``accelerate``
imports renamed to ``kwplug``.

- :func:`nd_parallel` is ``examples/torch_native_parallelism/nd_parallel.py`` (Accelerate
  1.16's repository): ``ParallelismConfig(dp_replicate_size, dp_shard_size, tp_size,
  cp_size)``, a ``FullyShardedDataParallelPlugin(fsdp_version=2,
  auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=[<layer>],
  state_dict_type="SHARDED_STATE_DICT")`` when ``dp_shard_enabled or cp_enabled``,
  ``Accelerator(parallelism_config=..., fsdp_plugin=...)``, its ``forward`` (loss reduced over
  ``torch_device_mesh["dp_cp"]`` when ``parallelism_config.dp_cp_dim_names``, inside
  ``maybe_context_parallel``), batch size 1. Adapted: the Llama model loaded with
  ``tp_plan="auto"`` is a two-layer MLP "decoder" carrying its own ``_tp_plan`` (what
  transformers gives the model); fp32 instead of bf16 (the comparison is bitwise-ish); gloo has
  no ``ReduceOp.AVG``, so the loss is summed and divided by the group's size; no tracker, no
  checkpoint, no ``save_pretrained``.
- :func:`fsdp_peak_mem` is ``examples/by_feature/fsdp_with_peak_mem_tracking.py``: the plugin
  built with ``state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=False)``
  and ``optim_state_dict_config=FullOptimStateDictConfig(...)``, ``Accelerator(cpu=...,
  mixed_precision=..., fsdp_plugin=...)``, ``main_process_first``, AdamW over two weight-decay
  groups, a linear warm-up schedule stepped with the optimizer every
  ``gradient_accumulation_steps`` batches, evaluation through ``gather_for_metrics``.
  Adapted: a tiny classifier and generated data instead of BERT on GLUE/MRPC, torch's
  ``LambdaLR`` for transformers' ``get_linear_schedule_with_warmup`` (the same formula), no
  tracemalloc/psutil, no tracker, no checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader


class DecoderLayer(nn.Module):
    """A residual MLP "decoder layer" (the unit FSDP's transformer policy wraps)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(width, 2 * width)
        self.down_proj = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(torch.relu(self.up_proj(x)))


class TinyCausalLM(nn.Module):
    """Embedding, two decoder layers, an LM head; ``forward(**batch)`` returns ``.loss`` as a
    transformers causal LM does (``shift_labels`` preferred over ``labels``)."""

    #: The model's own tensor-parallel plan (transformers models carry ``_tp_plan``).
    _tp_plan = {  # noqa: RUF012
        "layers.*.up_proj": "colwise",
        "layers.*.down_proj": "rowwise",
    }

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList([DecoderLayer(width), DecoderLayer(width)])
        self.lm_head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, **batch: torch.Tensor) -> Any:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.lm_head(h)
        labels = batch.get("shift_labels", batch.get("labels"))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return type("Output", (), {"loss": loss, "logits": logits})()


def _lm_dataset(n: int = 32, length: int = 8) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 32, (n, length + 1), generator=g)
    return [{"input_ids": row[:-1], "labels": row[:-1], "shift_labels": row[1:]} for row in ids]


def _collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def nd_parallel(dp_replicate_size: int, dp_shard_size: int, tp_size: int, steps: int) -> Any:
    """``nd_parallel.py``'s ``train`` and ``forward``; returns the reduced losses."""
    from kwplug import Accelerator
    from kwplug.parallelism_config import ParallelismConfig
    from kwplug.utils import FullyShardedDataParallelPlugin, set_seed

    set_seed(42)
    parallelism_config = ParallelismConfig(
        dp_replicate_size=dp_replicate_size,
        dp_shard_size=dp_shard_size,
        tp_size=tp_size,
        cp_size=1,
    )
    fsdp2_plugin = None
    if parallelism_config.dp_shard_enabled or parallelism_config.cp_enabled:
        fsdp2_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["DecoderLayer"],
            state_dict_type="SHARDED_STATE_DICT",
        )
    accelerator = Accelerator(
        mixed_precision="no", parallelism_config=parallelism_config, fsdp_plugin=fsdp2_plugin
    )
    torch.manual_seed(0)
    model = TinyCausalLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataloader = DataLoader(_lm_dataset(), batch_size=1, collate_fn=_collate)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)

    losses = []
    for step, batch in enumerate(dataloader):
        if step >= steps:
            break
        batch["position_ids"] = torch.arange(0, batch["input_ids"].size(1)).unsqueeze(0)
        buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"]]
        with accelerator.maybe_context_parallel(
            buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)
        ):
            loss_reduce_grp = (
                accelerator.torch_device_mesh["dp_cp"].get_group()
                if accelerator.parallelism_config.dp_cp_dim_names
                else None
            )
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            # gloo has no ReduceOp.AVG: the sum over the group, divided by its size.
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=loss_reduce_grp)
            loss = loss / dist.get_world_size(loss_reduce_grp)
        losses.append(loss.item())
    result = {
        "losses": losses,
        "mesh": list(accelerator.torch_device_mesh.mesh_dim_names),
        "distributed_type": accelerator.distributed_type.value,
    }
    accelerator.end_training()
    return result


def fsdp_peak_mem(use_fsdp: bool, num_epochs: int = 2) -> Any:
    """``fsdp_with_peak_mem_tracking.py``'s ``training_function``; returns the losses and the
    evaluation accuracy per epoch."""
    from torch.distributed.fsdp.fully_sharded_data_parallel import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
    )

    from kwplug import Accelerator, DistributedType, FullyShardedDataParallelPlugin
    from kwplug.utils import set_seed

    lr, seed, batch_size, gradient_accumulation_steps = 0.01, 42, 4, 2
    fsdp_plugin = FullyShardedDataParallelPlugin(
        state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False),
    )
    accelerator = Accelerator(
        cpu=True, mixed_precision="no", fsdp_plugin=fsdp_plugin if use_fsdp else None
    )
    accelerator.print(accelerator.distributed_type)
    with accelerator.main_process_first():
        g = torch.Generator().manual_seed(5)
        x = torch.randn(96, 12, generator=g)
        y = (x[:, :6].sum(1) > x[:, 6:].sum(1)).long()
    train = torch.utils.data.TensorDataset(x[:64], y[:64])
    valid = torch.utils.data.TensorDataset(x[64:], y[64:])
    train_dataloader = DataLoader(train, shuffle=True, batch_size=batch_size)
    eval_dataloader = DataLoader(valid, shuffle=False, batch_size=8)
    set_seed(seed)
    model = nn.Sequential(nn.Linear(12, 24), nn.LayerNorm(24), nn.ReLU(), nn.Linear(24, 2))
    no_decay = ["bias", "1.weight"]  # the LayerNorm's weight, as the script's "LayerNorm.weight"
    optimizer_grouped_parameters = [
        {
            "params": [
                p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)
            ],
            "weight_decay": 0.003,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(params=optimizer_grouped_parameters, lr=lr, weight_decay=2e-4)
    total = (len(train_dataloader) * num_epochs) // gradient_accumulation_steps

    def linear_warmup(step: int) -> float:  # transformers' get_linear_schedule_with_warmup
        if step < 10:
            return step / 10
        return max(0.0, (total - step) / max(1, total - 10))

    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    losses, accuracies = [], []
    for _epoch in range(num_epochs):
        model.train()
        for step, (inputs, labels) in enumerate(train_dataloader):
            loss = nn.functional.cross_entropy(model(inputs), labels)
            losses.append(float(accelerator.reduce(loss.detach(), "mean")))
            accelerator.backward(loss)
            if step % gradient_accumulation_steps == 0:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        model.eval()
        correct = seen = 0
        for inputs, labels in eval_dataloader:
            with torch.no_grad():
                predictions = model(inputs).argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, labels))
            correct += int((predictions == references).sum())
            seen += len(references)
        accuracies.append(correct / seen)
    result = {
        "losses": losses,
        "accuracies": accuracies,
        "seen": seen,
        "fsdp": accelerator.distributed_type == DistributedType.FSDP,
    }
    accelerator.end_training()
    return result

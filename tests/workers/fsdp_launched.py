"""A training script for ``kwplug launch``: in mode ``launched`` it calls ``Accelerator()``
only, so FSDP2 and the device mesh come from the launcher's variables (``--config_file`` with
``distributed_type: FSDP``); in mode ``code`` it builds the same plugins itself
(``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...),
parallelism_config=ParallelismConfig(dp_shard_size=2))``).

Usage: ``fsdp_launched.py MODE OUT_DIR``. Each rank writes ``OUT_DIR/rank<i>.json`` (losses,
whether every parameter is a ``DTensor`` shard, the plugins' fields, the mesh); the main
process writes the full trained weights to ``OUT_DIR/weights.pt``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from kwplug import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig


class Block(nn.Module):
    """A residual MLP block: the class the transformer-based policy shards on its own."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.inner(x))


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "code":
        accelerator = Accelerator(
            fsdp_plugin=FullyShardedDataParallelPlugin(
                fsdp_version=2,
                auto_wrap_policy="transformer_based_wrap",
                transformer_cls_names_to_wrap=["Block"],
                reshard_after_forward=True,
                state_dict_type="SHARDED_STATE_DICT",
                cpu_ram_efficient_loading=True,
                activation_checkpointing=True,
            ),
            parallelism_config=ParallelismConfig(dp_shard_size=2),
        )
    else:
        accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), Block(16), Block(16), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 6, generator=generator), torch.randn(64, 2))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, 4))
    sharded = [isinstance(p, DTensor) for p in model.parameters()]
    local = [list(p.to_local().shape) for p in model.parameters() if isinstance(p, DTensor)]
    losses = []
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in accelerator.unwrap_model(model).state_dict().items()
    }
    mesh = accelerator.torch_device_mesh
    record = {
        "losses": losses,
        "sharded": sharded,
        "local_shapes": local,
        "handlers": [repr(h) for h in accelerator.handlers],
        "distributed_type": str(accelerator.distributed_type.value),
        "is_fsdp2": accelerator.is_fsdp2,
        "mesh": None if mesh is None else list(mesh.mesh_dim_names),
        "parallelism_config": repr(accelerator.parallelism_config),
        # Accelerate's scripts read the plugins back from the state.
        "state_fsdp_plugin": repr(accelerator.state.fsdp_plugin),
        "state_parallelism_config": repr(accelerator.state.parallelism_config),
        "variables": sorted(k for k in os.environ if k.startswith(("FSDP_", "PARALLELISM_"))),
    }
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))
    if accelerator.is_main_process:
        torch.save(full, out / "weights.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()

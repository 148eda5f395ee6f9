"""The built-in ``fsdp`` and ``parallelism`` plugins in 2 and 4 gloo processes: FSDP2, HSDP and
tensor parallelism train the same fp32 weights as kwplug's DDP (reduction-order tolerance),
the clip norm is the unsharded one, data loaders shard over the data-parallel ranks only,
and ``save_model`` of a sharded model writes the full weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import safetensors.torch
import torch
from torch import nn

import kwplug
from kwplug.testing import run_distributed

STEPS = 4
TOL = 1e-5  # fp32, reduction order only


class Block(nn.Module):
    """A residual MLP block: the unit the transformer policy shards on its own."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.inner(x))


class Net(nn.Module):
    """Two blocks between an input and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.Sequential(Block(16), Block(16))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(torch.relu(self.inp(x))))


#: Each hidden layer split by columns (its output gathered), the output layer by rows.
TP_PLAN = {"inp": "colwise_rep", "blocks.*.inner": "colwise_rep", "out": "rowwise_rep"}


def _data() -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    y = x.sum(dim=1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def train(mode: str, out: str) -> dict[str, Any]:
    """One training run under ``mode``; rank results (losses, full weights, norms)."""
    from torch.distributed.tensor import DTensor

    from kwplug import FullyShardedDataParallelPlugin, ParallelismConfig

    options: dict[str, Any] = {"gradient_accumulation_steps": 2}
    world = int(__import__("os").environ["WORLD_SIZE"])
    fsdp = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
    )  # fmt: skip
    if mode == "fsdp":
        options["fsdp_plugin"] = fsdp
    elif mode == "hsdp":
        options["fsdp_plugin"] = fsdp
        options["parallelism_config"] = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    elif mode == "tp":
        options["parallelism_config"] = ParallelismConfig(tp_size=world, tp_handler=TP_PLAN)
    elif mode == "fsdp_tp":
        options["fsdp_plugin"] = fsdp
        options["parallelism_config"] = ParallelismConfig(
            dp_shard_size=2, tp_size=2, tp_handler=TP_PLAN
        )
    accelerator = kwplug.Accelerator(**options)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _data())
    losses, norms, firsts = [], [], []
    for step, (x, y) in enumerate(loader):
        if step >= 2 * STEPS:
            break
        firsts.append(float(x[0, 0]))
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in accelerator.unwrap_model(model).state_dict().items()
    }
    accelerator.save_model(model, out, max_shard_size="1KB")
    mesh = accelerator.torch_device_mesh
    result = {
        "losses": losses,
        "norms": norms,
        "firsts": firsts,
        "weights": {k: v.tolist() for k, v in full.items()},
        "distributed_type": str(accelerator.distributed_type.value),
        "is_fsdp2": accelerator.is_fsdp2,
        "dtensor": any(isinstance(p, DTensor) for p in model.parameters()),
        "mesh": None if mesh is None else list(mesh.mesh_dim_names),
        "unwrapped_is_model": accelerator.unwrap_model(model) is model,
    }
    accelerator.end_training()
    return result


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max()) for k in a)


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("two")
    runs: dict[str, Any] = {
        mode: run_distributed(train, mode, str(root / mode), nproc=2, timeout=240)
        for mode in ("ddp", "fsdp", "tp")
    }
    return {**runs, "root": str(root)}


@pytest.mark.timeout(900)  # several torchrun jobs (the module fixture's) on 2 cores
def test_fsdp2_trains_as_ddp(two: dict[str, Any]) -> None:
    ddp, fsdp = two["ddp"][0], two["fsdp"][0]
    assert fsdp["distributed_type"] == "FSDP" and fsdp["is_fsdp2"] and fsdp["dtensor"]
    assert ddp["distributed_type"] == "MULTI_CPU" and not ddp["dtensor"]
    assert fsdp["mesh"] == ["dp_shard"] and fsdp["unwrapped_is_model"]
    assert len(fsdp["losses"]) == 2 * STEPS
    assert max(abs(a - b) for a, b in zip(fsdp["losses"], ddp["losses"], strict=True)) < TOL
    assert max(abs(a - b) for a, b in zip(fsdp["norms"], ddp["norms"], strict=True)) < TOL
    assert _max_diff(fsdp["weights"], ddp["weights"]) < TOL
    assert fsdp["weights"] != Net().state_dict()  # it trained
    # Each rank read its own batches, as under DDP.
    assert two["fsdp"][0]["firsts"] != two["fsdp"][1]["firsts"]


def test_tensor_parallel_ranks_read_the_same_batches(two: dict[str, Any]) -> None:
    tp0, tp1 = two["tp"]
    assert tp0["mesh"] == ["tp"] and tp0["dtensor"]
    assert tp0["firsts"] == tp1["firsts"]  # one TP group: one data-parallel rank
    assert tp0["losses"] == tp1["losses"]


def test_save_model_of_a_sharded_model_writes_full_weights(two: dict[str, Any]) -> None:
    folder = Path(two["root"]) / "fsdp"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(safetensors.torch.load_file(folder / name))
    assert set(tensors) == set(Net().state_dict())
    for name, tensor in tensors.items():  # the full, trained weights: rank 0's gathered copy
        assert torch.equal(tensor, torch.tensor(two["fsdp"][0]["weights"][name])), name
    assert len(set(index["weight_map"].values())) > 1  # max_shard_size split it


@attrs.define
class OwnMesh(kwplug.KwargsHandler):
    """A third-party mesh: one dimension named ``dim``; wrap_model records what it got."""

    dim: str = "dp"

    @kwplug.hookimpl
    def device_mesh(self, device_type: str, world_size: int) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (world_size,), mesh_dim_names=(self.dim,))

    @kwplug.hookimpl
    def wrap_model(self, model: nn.Module, device_mesh: Any) -> nn.Module:
        model.seen_mesh = device_mesh  # type: ignore[assignment]
        return model


def own_mesh(dim: str) -> dict[str, Any]:
    """Which batches this rank reads under ``OwnMesh(dim)``, and what wrap_model saw."""
    accelerator = kwplug.Accelerator(kwargs_handlers=[OwnMesh(dim)])
    model, loader = accelerator.prepare(nn.Linear(8, 1), _data())
    firsts = [float(x[0, 0]) for x, _ in loader]
    result = {
        "firsts": firsts,
        "mesh_is_torch_device_mesh": model.seen_mesh is accelerator.torch_device_mesh,
        "dims": list(accelerator.torch_device_mesh.mesh_dim_names),
        "answered": accelerator.plan["device_mesh"].plugin,
    }
    accelerator.end_training()
    return result


def test_hook_device_mesh() -> None:
    on_dp = run_distributed(own_mesh, "dp", nproc=2, timeout=120)
    on_other = run_distributed(own_mesh, "other", nproc=2, timeout=120)
    assert on_dp[0]["mesh_is_torch_device_mesh"] and on_dp[0]["dims"] == ["dp"]
    assert on_dp[0]["answered"] == "user[0]:test_fsdp_mesh.OwnMesh"
    # Along "dp" the ranks split the data (16 batches: 8 each); without it they read it all.
    assert len(on_dp[0]["firsts"]) == 8 and on_dp[0]["firsts"] != on_dp[1]["firsts"]
    assert len(on_other[0]["firsts"]) == 16 and on_other[0]["firsts"] == on_other[1]["firsts"]


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("four")
    return {
        mode: run_distributed(train, mode, str(root / mode), nproc=4, timeout=400)
        for mode in ("ddp", "hsdp", "fsdp_tp")
    }


@pytest.mark.timeout(900)  # several torchrun jobs (the module fixture's) on 2 cores
def test_hsdp_trains_as_ddp_in_four_processes(four: dict[str, Any]) -> None:
    ddp, hsdp = four["ddp"][0], four["hsdp"][0]
    assert hsdp["mesh"] == ["dp_replicate", "dp_shard"] and hsdp["dtensor"]
    assert hsdp["distributed_type"] == "FSDP"
    assert max(abs(a - b) for a, b in zip(hsdp["losses"], ddp["losses"], strict=True)) < TOL
    assert _max_diff(hsdp["weights"], ddp["weights"]) < TOL
    assert len({tuple(r["firsts"]) for r in four["hsdp"]}) == 4  # four data-parallel ranks


@pytest.mark.timeout(900)  # several torchrun jobs (the module fixture's) on 2 cores
def test_fsdp_with_tensor_parallelism_trains_as_two_process_ddp(
    four: dict[str, Any], two: dict[str, Any]
) -> None:
    # dp_shard=2 x tp=2: two data-parallel ranks, so the batches of a 2-process DDP run.
    ddp, both = two["ddp"][0], four["fsdp_tp"]
    assert both[0]["mesh"] == ["dp_shard", "tp"] and both[0]["dtensor"]
    firsts = [r["firsts"] for r in both]
    assert firsts[0] == firsts[1] and firsts[2] == firsts[3] and firsts[0] != firsts[2]
    assert firsts[0] == two["ddp"][0]["firsts"] and firsts[2] == two["ddp"][1]["firsts"]
    assert max(abs(a - b) for a, b in zip(both[0]["losses"], ddp["losses"], strict=True)) < TOL
    assert _max_diff(both[0]["weights"], ddp["weights"]) < TOL


def accelerate_fsdp2() -> dict[str, Any]:
    """The same run as ``train("fsdp")`` through Accelerate 1.16's own FSDP2, forced onto gloo.

    Accelerate trains an FSDP plugin as plain DDP on CPU; its FSDP2 path runs there once its
    shared state (``PartialState`` and ``AcceleratorState``) says ``FSDP`` and holds the
    plugin (docs: /work/shared/notes/sharding-facts.md).
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.tensor import DTensor

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
    )  # fmt: skip
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, fsdp_plugin=plugin)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin
    assert accelerator.is_fsdp2
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _data())
    losses, norms = [], []
    for step, (x, y) in enumerate(loader):
        if step >= 2 * STEPS:
            break
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
    weights = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).tolist()
        for k, v in model.state_dict().items()
    }
    assert isinstance(model.inp.weight, DTensor)
    accelerator.end_training()
    return {"losses": losses, "norms": norms, "weights": weights}


@pytest.mark.timeout(900)  # several torchrun jobs (the module fixture's) on 2 cores
def test_fsdp2_equals_accelerates_fsdp2_forced_onto_gloo(two: dict[str, Any]) -> None:
    pytest.importorskip("accelerate")
    theirs = run_distributed(accelerate_fsdp2, nproc=2, timeout=240)[0]
    ours = two["fsdp"][0]
    assert ours["losses"] == theirs["losses"]  # bitwise: the same torch calls
    assert ours["norms"] == theirs["norms"]
    assert _max_diff(ours["weights"], theirs["weights"]) == 0.0

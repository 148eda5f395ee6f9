"""kwplug-fsdp: FullyShardedKwargs as an object, through discovery and in 2-process runs.

Needs kwplug-fsdp installed (``pip install -e examples/plugins/kwplug-fsdp``). The distributed
checks run in two CPU processes under torchrun (gloo) through ``kwplug.testing``; each worker
gathers several facts, so that the whole module stays within a few torchrun start-ups.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from kwplug_fsdp import FullyShardedKwargs
from torch import nn

import kwplug
from kwplug import checkpoint
from kwplug.config import ConfigError
from kwplug.testing import PluginSandbox, check_handler, run_distributed, run_script

REPO = Path(__file__).resolve().parents[4]
EXAMPLE = REPO / "examples" / "train_digits.py"
CONFIG = REPO / "examples" / "fsdp.toml"


class Block(nn.Module):
    """A residual MLP block: the unit to shard on its own."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.inner(x))


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(8, 32), Block(32), Block(32), nn.Linear(32, 1))


def full_weights(model: nn.Module) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return torch.cat(
        [
            (p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1)
            for p in model.parameters()
        ]
    )


# -- workers (run in every rank by run_distributed) -------------------------------------------


def train_worker(precisions: tuple[str, ...]) -> dict[str, Any]:
    """``train`` under each precision, and the DDP plan, in one job (one torchrun start-up)."""
    return {**{mp: train(mp) for mp in precisions}, "default_plan": _ddp_plan()}


def train(mixed_precision: str) -> dict[str, Any]:
    """Train with FSDP2 (optimizer created before prepare); report what the test checks."""
    from torch.distributed.tensor import DTensor, Shard

    accelerator = kwplug.Accelerator(
        mixed_precision=mixed_precision,
        cpu=True,
        kwargs_handlers=[FullyShardedKwargs(shard_modules=("Block",))],
    )
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    dtypes: list[torch.dtype] = []
    model[1].inner.register_forward_pre_hook(lambda m, args: dtypes.append(m.weight.dtype))

    torch.manual_seed(100 + accelerator.process_index)  # different data on every rank
    x = torch.randn(64, 8)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for _ in range(25):
        with accelerator.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach().float(), "mean").item())

    params = dict(model.named_parameters())
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return {
        "losses": losses,
        "weights": full_weights(model),
        "plan": accelerator.plan["wrap_model"].plugin,
        "all_dtensor": all(isinstance(p, DTensor) for p in params.values()),
        "placements": {n: tuple(p.placements) == (Shard(0),) for n, p in params.items()},
        "local_rows": {n: p.to_local().shape[0] for n, p in params.items()},
        "full_rows": {n: p.shape[0] for n, p in params.items()},
        "optimizer_on_model": stepped == {id(p) for p in params.values()},
        "forward_dtype": str(dtypes[0]),
    }


def _ddp_plan() -> Any:
    # Without FullyShardedKwargs (opt-in) the built-in DDP handler wraps the model.
    accelerator = kwplug.Accelerator(cpu=True)
    wrapped = accelerator.prepare(make_model())
    return accelerator.plan["wrap_model"].plugin, type(wrapped).__name__


def checkpoint_worker(directory: str, precisions: tuple[str, ...]) -> dict[str, Any]:
    return {mp: checkpoint_round_trip(f"{directory}/{mp}", mp) for mp in precisions}


def checkpoint_round_trip(directory: str, case: str) -> dict[str, Any]:
    """Save after a few steps, go on; a fresh model and optimizer loaded from the checkpoint
    must go on identically (bitwise). ``case``: the mixed precision, ``+sgd`` for a
    stateless optimizer (plain SGD: no tensor state to shard)."""
    mixed_precision, _, stateless = case.partition("+")

    def setup() -> tuple[kwplug.Accelerator, nn.Module, torch.optim.Optimizer]:
        accelerator = kwplug.Accelerator(
            mixed_precision=mixed_precision,
            cpu=True,
            kwargs_handlers=[FullyShardedKwargs(shard_modules=(nn.Linear,))],
        )
        model = make_model()
        optimizer: torch.optim.Optimizer = (
            torch.optim.SGD(model.parameters(), lr=1e-2)
            if stateless
            else torch.optim.AdamW(model.parameters(), lr=1e-2)
        )
        model, optimizer = accelerator.prepare(model, optimizer)
        return accelerator, model, optimizer

    torch.manual_seed(7 + int(os.environ["RANK"]))
    x = torch.randn(16, 8)
    y = x.sum(dim=1, keepdim=True)

    def steps(
        accelerator: kwplug.Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, n: int
    ) -> list[float]:
        out = []
        for _ in range(n):
            with accelerator.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        return out

    accelerator, model, optimizer = setup()
    steps(accelerator, model, optimizer, 4)
    accelerator.save_state(directory)
    expected = steps(accelerator, model, optimizer, 3)
    expected_weights = full_weights(model)

    resumed, model, optimizer = setup()
    resumed.load_state(directory)
    got = steps(resumed, model, optimizer, 3)
    return {
        "expected": expected,
        "got": got,
        "same_weights": torch.equal(expected_weights, full_weights(model)),
    }


@pytest.fixture
def fsdp_installed(kwplug_plugins: PluginSandbox) -> PluginSandbox:
    """Discovery sees kwplug's built-ins and this plugin only; KWPLUG_* cleared."""
    kwplug_plugins.keep_installed("kwplug-fsdp")
    return kwplug_plugins


# -- the handler as an object -----------------------------------------------------------------


def test_conformance() -> None:
    check_handler(
        FullyShardedKwargs,
        examples={
            "shard_modules": ("Linear",),
            "min_num_params": 1000,
            "reshard_after_forward": False,
            "cast_params": False,
            "reduce_dtype": "bfloat16",
            "output_dtype": "float32",
            "cast_forward_inputs": False,
        },
    )
    assert FullyShardedKwargs.register_default is False


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("shard_modules", 3, TypeError),
        ("shard_modules", ("Linear", 3), TypeError),
        ("shard_modules", (int,), TypeError),
        ("shard_modules", ("",), ValueError),
        ("min_num_params", -1, ValueError),
        ("min_num_params", 1.5, TypeError),
        ("min_num_params", True, TypeError),
        ("reshard_after_forward", 1, TypeError),
        ("cast_params", "yes", TypeError),
        ("reduce_dtype", "float64", ValueError),
        ("reduce_dtype", torch.float64, ValueError),
        ("reduce_dtype", 16, TypeError),
        ("output_dtype", "bf16", ValueError),
        ("cast_forward_inputs", None, TypeError),
    ],
)
def test_bad_values_name_the_field(field: str, value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=f"'{field}'"):
        FullyShardedKwargs(**{field: value})
    handler = FullyShardedKwargs()
    with pytest.raises(error, match=f"'{field}'"):
        setattr(handler, field, value)  # validated on assignment too


def test_conversions() -> None:
    handler = FullyShardedKwargs(shard_modules=["Linear", Block], reduce_dtype=torch.bfloat16)
    assert handler.shard_modules == ("Linear", Block)
    assert handler.reduce_dtype == "bfloat16"  # stored by name: TOML- and pickle-friendly
    assert FullyShardedKwargs(shard_modules="Block").shard_modules == ("Block",)


@pytest.mark.parametrize(
    ("handler", "mixed_precision", "expected"),
    [
        (FullyShardedKwargs(), "no", (None, None, None)),
        (FullyShardedKwargs(), "bf16", (torch.bfloat16, torch.float32, None)),
        (FullyShardedKwargs(), "fp16", (torch.float16, torch.float32, None)),
        (FullyShardedKwargs(reduce_dtype="bfloat16"), "bf16", (torch.bfloat16,) * 2 + (None,)),
        (FullyShardedKwargs(reduce_dtype="bfloat16"), "no", (None, torch.bfloat16, None)),
        (FullyShardedKwargs(cast_params=False), "bf16", (None, None, None)),
        (
            FullyShardedKwargs(output_dtype="float32"),
            "bf16",
            (torch.bfloat16, torch.float32, torch.float32),
        ),
    ],
)
def test_mixed_precision_policy(
    handler: FullyShardedKwargs, mixed_precision: str, expected: tuple[Any, ...]
) -> None:
    policy = handler.mixed_precision_policy(mixed_precision)
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == expected
    assert policy.cast_forward_inputs is handler.cast_forward_inputs
    with pytest.raises(ValueError, match="mixed_precision"):
        handler.mixed_precision_policy("fp8")


def test_modules_to_shard() -> None:
    model = make_model()
    blocks = [model[1], model[2]]
    assert FullyShardedKwargs().modules_to_shard(model) == []
    assert FullyShardedKwargs(shard_modules=("Block",)).modules_to_shard(model) == blocks
    # Children before parents; classes match subclasses; qualified names work too.
    chosen = FullyShardedKwargs(shard_modules=(nn.Linear, "Block")).modules_to_shard(model)
    assert chosen == [model[0], model[1].inner, model[1], model[2].inner, model[2], model[3]]
    qualified = FullyShardedKwargs(shard_modules=("torch.nn.modules.linear.Linear",))
    assert len(qualified.modules_to_shard(model)) == 4
    # Size-based: a Block (32*32+32 parameters) qualifies once, through its inner Linear.
    assert FullyShardedKwargs(min_num_params=1000).modules_to_shard(model) == [
        model[1].inner,
        model[2].inner,
    ]
    with pytest.raises(ValueError, match=r"'Blok'.*'Block'.*'Linear'"):
        FullyShardedKwargs(shard_modules=("Blok",)).modules_to_shard(model)


@pytest.mark.usefixtures("fsdp_installed")
def test_single_process_declines_but_checks_names() -> None:
    accelerator = kwplug.Accelerator(cpu=True, kwargs_handlers=[FullyShardedKwargs()])
    model = make_model()
    assert accelerator.prepare(model) is model
    assert accelerator.plan["wrap_model"].plugin is None  # every plugin declined
    asked = accelerator.plan["wrap_model"].asked
    assert asked[0].endswith("FullyShardedKwargs") and asked[-1] == "kwplug:ddp"
    bad = kwplug.Accelerator(cpu=True, kwargs_handlers=[FullyShardedKwargs(shard_modules="X")])
    with pytest.raises(ValueError, match="shard_modules"):
        bad.prepare(make_model())


# -- discovery, loading controls, configuration ----------------------------------------------


def plugins_json(env: dict[str, str]) -> list[dict[str, Any]]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KWPLUG_")}
    proc = subprocess.run(
        [sys.executable, "-m", "kwplug", "plugins", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
        check=True,
    )
    records: list[dict[str, Any]] = json.loads(proc.stdout)
    return records


def test_listed_as_third_party_plugin() -> None:
    # Named "fully_sharded", not "fsdp" (kwplug's built-in FullyShardedDataParallelPlugin).
    (record,) = [r for r in plugins_json({}) if r["name"] == "fully_sharded"]
    assert record["distribution"] == "kwplug-fsdp"
    assert record["version"] == "0.1.0"
    assert record["hooks"] == ["no_sync", "wrap_model"]
    assert record["status"] == "loaded"
    assert record["source"] == "third-party"


@pytest.mark.usefixtures("fsdp_installed")
def test_blocked_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "fully_sharded"
    records = plugins_json({"KWPLUG_BLOCK_PLUGINS": name})
    (record,) = [r for r in records if r["name"] == name]
    assert record["status"] == "blocked"
    monkeypatch.setenv("KWPLUG_BLOCK_PLUGINS", name)
    with pytest.raises(ConfigError, match=r"'fully_sharded' \(kwplug-fsdp .*\(blocked\)"):
        kwplug.Accelerator.from_config({"handlers": {name: {"shard_modules": ["Linear"]}}})


@pytest.mark.usefixtures("fsdp_installed")
def test_configured_by_entry_point_name() -> None:
    accelerator = kwplug.Accelerator.from_config(CONFIG, cpu=True)
    (handler,) = [h for h in accelerator.handlers if isinstance(h, FullyShardedKwargs)]
    assert handler.shard_modules == ("Linear",)
    with pytest.raises(ConfigError, match=r"\[handlers\.fully_sharded\].*'reduce_dtype'"):
        kwplug.Accelerator.from_config({"handlers": {"fully_sharded": {"reduce_dtype": "int8"}}})


# -- two processes ----------------------------------------------------------------------------


TRAIN_PRECISIONS = ("no", "bf16")
CHECKPOINT_PRECISIONS = ("no", "fp16", "no+sgd")


@pytest.fixture(scope="module")
def trained() -> list[dict[str, Any]]:
    # The ranks see kwplug's built-ins and this plugin only, whatever else is installed.
    with PluginSandbox(keep_installed=["kwplug-fsdp"]):
        return run_distributed(train_worker, TRAIN_PRECISIONS, nproc=2, timeout=120)


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("ckpt")
    with PluginSandbox(keep_installed=["kwplug-fsdp"]):
        ranks = run_distributed(
            checkpoint_worker, str(directory), CHECKPOINT_PRECISIONS, nproc=2, timeout=120
        )
    return directory, ranks


def test_two_process_default_is_ddp(trained: list[dict[str, Any]]) -> None:
    for rank in trained:
        assert rank["default_plan"] == ("kwplug:ddp", "DistributedDataParallel")


@pytest.mark.parametrize("mixed_precision", TRAIN_PRECISIONS)
def test_two_process_training(trained: list[dict[str, Any]], mixed_precision: str) -> None:
    ranks = [rank[mixed_precision] for rank in trained]
    for rank in ranks:
        assert rank["plan"].endswith("kwplug_fsdp.FullyShardedKwargs"), rank["plan"]
        assert rank["all_dtensor"] and all(rank["placements"].values()), rank["placements"]
        assert rank["optimizer_on_model"]  # the optimizer built before prepare follows
        assert (
            rank["forward_dtype"]
            == {"no": "torch.float32", "bf16": "torch.bfloat16"}[mixed_precision]
        )
        losses = rank["losses"]
        assert losses[-1] < 0.5 * losses[0], losses
    # Each rank holds a part of every parameter: together the full rows, each fewer of them.
    local = [rank["local_rows"] for rank in ranks]
    for name, rows in ranks[0]["full_rows"].items():
        assert sum(shards[name] for shards in local) == rows, name
        if rows > 1:
            assert all(shards[name] < rows for shards in local), name
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])
    assert ranks[0]["losses"] == ranks[1]["losses"]


@pytest.mark.parametrize("mixed_precision", CHECKPOINT_PRECISIONS)
def test_two_process_checkpoint_resumes_exactly(
    checkpointed: tuple[Path, list[dict[str, Any]]], mixed_precision: str
) -> None:
    directory, ranks = checkpointed
    for rank in (rank[mixed_precision] for rank in ranks):
        assert rank["got"] == rank["expected"]
        assert rank["same_weights"]
    # Each rank wrote its own shards (SHARDED_STATE_DICT, the default) as a plain safetensors
    # file: together they hold every row of every parameter.
    version = checkpoint.resolve_checkpoint(directory / mixed_precision)
    assert version is not None
    shards = [
        safetensors.torch.load_file(version / f"model_0-shard_{r:05d}.safetensors") for r in (0, 1)
    ]
    for name, tensor in make_model().state_dict().items():
        assert sum(s[name].shape[0] for s in shards if name in s) == tensor.shape[0], name


def test_digits_example_with_config(kwplug_plugins: PluginSandbox) -> None:
    """examples/train_digits.py --config examples/fsdp.toml: no import of kwplug_fsdp."""
    kwplug_plugins.keep_installed("kwplug-fsdp")
    output = run_script(
        EXAMPLE, "--config", str(CONFIG), "--cpu", "--no-progress", "--mixed-precision", "bf16"
    )
    found = dict(re.findall(r"(?m)^(\w+)=(\S+)$", output))
    assert "wrap_model: user[0]:kwplug_fsdp.FullyShardedKwargs" in output
    assert found["ranks_identical"] == "True", output
    assert float(found["final_accuracy"]) >= 0.95, output


def test_no_sync_declines_a_model_it_did_not_shard() -> None:
    # In one process the model is not sharded: not this plugin's wrapper, so None (and the
    # Accelerator falls back to nullcontext). Sharded: tests/test_accumulation_distributed.py.
    assert FullyShardedKwargs().no_sync(torch.nn.Linear(2, 2)) is None

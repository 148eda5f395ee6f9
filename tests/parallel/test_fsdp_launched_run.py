"""End to end: a script that only calls ``Accelerator()``, run by ``kwplug launch
--config_file fsdp.yaml`` (Accelerate's ``distributed_type: FSDP`` file) in 2 gloo processes,
trains with a really sharded model (``DTensor`` parameters, half of each per rank) to the
same losses and full weights (``torch.equal``) as the script building the same plugins in
code -- the rename-only port of Accelerate's most common FSDP setup."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kwplug.testing.distributed import child_environment, run_bounded

WORKER = Path(__file__).resolve().parents[1] / "workers" / "fsdp_launched.py"
TIMEOUT = 300.0

#: What `accelerate config` writes for FSDP2 with a transformer-based wrap (its key names).
FSDP_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: Block
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
parallelism_config:
  parallelism_config_dp_shard_size: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""


def _run(launch: list[str], mode: str, out: Path) -> dict[str, Any]:
    out.mkdir()
    env = child_environment({"HF_HOME": str(out / "hf_home")})  # no user's default config
    command = [sys.executable, "-m", "kwplug", "launch", *launch, str(WORKER), mode, str(out)]
    done = run_bounded(command, timeout=TIMEOUT, env=env)
    assert done.returncode == 0, done.stdout[-6000:]
    return {
        "ranks": [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))],
        "weights": torch.load(out / "weights.pt", weights_only=True),
        "output": done.stdout,
    }


@pytest.mark.timeout(900)
def test_a_launched_fsdp_config_trains_as_the_plugin_built_in_code(tmp_path: Path) -> None:
    config = tmp_path / "fsdp.yaml"
    config.write_text(FSDP_YAML)
    launched = _run(["--config_file", str(config)], "launched", tmp_path / "launched")
    coded = _run(["--num_processes", "2"], "code", tmp_path / "code")
    assert len(launched["ranks"]) == len(coded["ranks"]) == 2
    for ours, theirs in zip(launched["ranks"], coded["ranks"], strict=True):
        # Really sharded: every parameter a DTensor holding half of its rows.
        assert ours["sharded"] and all(ours["sharded"])
        assert ours["local_shapes"][0] == [8, 6]  # the first Linear's (16, 6) weight, halved
        assert ours["distributed_type"] == "FSDP" and ours["is_fsdp2"]
        assert ours["mesh"] == ["dp_shard"]
        # The launcher's variables built the plugins the script builds in code, field by field.
        assert ours["handlers"] == theirs["handlers"]
        assert ours["parallelism_config"] == theirs["parallelism_config"] != "None"
        assert ours["state_parallelism_config"] == ours["parallelism_config"]
        assert ours["state_fsdp_plugin"] == theirs["state_fsdp_plugin"]
        assert ours["state_fsdp_plugin"].startswith("FullyShardedDataParallelPlugin(")
        assert "FSDP_VERSION" in ours["variables"] and theirs["variables"] == []
        assert ours["losses"] == theirs["losses"] and len(ours["losses"]) == 8
    assert launched["weights"].keys() == coded["weights"].keys()
    for name, tensor in coded["weights"].items():
        assert torch.equal(launched["weights"][name], tensor), name
    assert not torch.equal(coded["weights"]["0.weight"], _initial()["0.weight"])  # it trained


def _initial() -> dict[str, torch.Tensor]:
    sys.path.insert(0, str(WORKER.parent))
    try:
        from fsdp_launched import Block
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), Block(16), Block(16), torch.nn.Linear(16, 2)
    )
    return model.state_dict()

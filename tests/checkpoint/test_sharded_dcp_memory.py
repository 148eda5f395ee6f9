"""Memory of sharded checkpoints (SHARDED_STATE_DICT), measured: 2 processes, an FSDP2 model
of 32 MiB of parameters and AdamW (48 MiB of state per rank); each rank's peak extra resident
set is at most 0.1x its shard on save (streamed, no copy) and 1.1x on load. Measured by the
sharded checkpoint benchmark's own worker (benchmarks/checkpoint_sharded.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kwplug.testing import PluginSandbox

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import checkpoint_sharded  # noqa: E402

pytest.importorskip("kwplug_fsdp")


def test_sharded_save_streams_and_load_stays_within_the_shard(tmp_path: Path) -> None:
    with PluginSandbox(keep_installed=["kwplug-fsdp"]) as sandbox:
        ranks = checkpoint_sharded.run_job(2, 32 << 20, str(tmp_path), env=sandbox.environment())
    assert len(ranks) == 2
    for rank in ranks:
        shard = rank["shard_bytes"]
        assert 48 << 20 <= shard < (48 << 20) + 1024  # 32 MiB + Adam, halved (+ its steps)
        save_extra, load_extra = rank["kwplug"]["save"][1], rank["kwplug"]["load"][1]
        print(rank["rank"], save_extra / shard, load_extra / shard)
        assert save_extra <= 0.1 * shard
        assert load_extra <= 1.1 * shard

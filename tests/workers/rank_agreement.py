"""Worker for tests/training/test_rank_agreement.py: 2 processes under torchrun (gloo).

``python rank_agreement.py SCENARIO OUT_DIR``: builds one Accelerator whose settings depend on
the rank as SCENARIO says, and writes ``OUT_DIR/rank_<r>.json``: ``{"ok": true}`` when the
construction passed, else the error's type, message and (for RankMismatchError) its field and
values; then re-raises, so a rank that failed exits non-zero.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

RANK = int(os.environ["RANK"])
if sys.argv[1] == "plugins" and RANK == 1:  # one node without the profile plugin
    os.environ["KWPLUG_BLOCK_PLUGINS"] = "profile"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import kwplug  # noqa: E402
from kwplug import DistributedDataParallelKwargs, InitProcessGroupKwargs  # noqa: E402
from kwplug.accelerator import _agreement  # noqa: E402


def ddp(**fields: Any) -> list[kwplug.KwargsHandler]:
    return [DistributedDataParallelKwargs(**fields)]


def power_sgd(rank: int) -> list[kwplug.KwargsHandler]:
    return ddp(comm_hook="power_sgd", comm_state_option={"matrix_approximation_rank": rank})


#: scenario -> the Accelerator keywords of rank 0 and of rank 1.
SCENARIOS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "mixed_precision": ({"mixed_precision": "bf16"}, {"mixed_precision": "no"}),
    "gradient_accumulation_steps": (
        {"gradient_accumulation_steps": 2},
        {"gradient_accumulation_steps": 4},
    ),
    "bucket_cap_mb": (
        {"kwargs_handlers": ddp(bucket_cap_mb=10)},
        {"kwargs_handlers": ddp(bucket_cap_mb=50)},
    ),
    "comm_hook": ({"kwargs_handlers": ddp(comm_hook="fp16")}, {}),
    "power_sgd_rank": ({"kwargs_handlers": power_sgd(1)}, {"kwargs_handlers": power_sgd(2)}),
    "plugins": ({}, {}),  # KWPLUG_BLOCK_PLUGINS differs, above
    "torch_version": ({}, {}),  # the version source differs, below
    # Equal settings, given differently: a handler with default values on one rank only.
    "agree": (
        {
            "mixed_precision": "bf16",
            "gradient_accumulation_steps": 2,
            "kwargs_handlers": [*power_sgd(2), InitProcessGroupKwargs()],
        },
        {
            "mixed_precision": "bf16",
            "gradient_accumulation_steps": 2,
            "kwargs_handlers": power_sgd(2),
        },
    ),
}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    if scenario == "torch_version" and RANK == 1:  # a node with another torch build
        versions = dict(_agreement._versions(), **{"torch version": "2.12.1+cpu"})
        _agreement._versions = lambda: versions  # type: ignore[assignment]
    if scenario == "absent_rank":
        # Rank 1 joins the process group but never constructs an Accelerator.
        if RANK == 1:
            # Its own rendezvous waits for rank 0's import (seconds on a loaded machine): the
            # 3 s under test is rank 0's, below.
            dist.init_process_group("gloo", timeout=timedelta(seconds=60))
            time.sleep(20)
            return
        kwargs: dict[str, Any] = {"kwargs_handlers": [InitProcessGroupKwargs(timeout=3)]}
    else:
        kwargs = SCENARIOS[scenario][RANK]
    started = time.monotonic()
    try:
        accelerator = kwplug.Accelerator(cpu=True, **kwargs)
        if scenario == "agree":  # and they train: one DDP step through the PowerSGD hook
            model = accelerator.prepare(torch.nn.Linear(4, 4))
            with accelerator.autocast():
                loss = model(torch.ones(2, 4)).float().sum()
            accelerator.backward(loss)
    except Exception as exc:
        result = {
            "ok": False,
            "type": type(exc).__name__,
            "message": str(exc),
            "field": getattr(exc, "field", None),
            "values": list(getattr(exc, "values", ())),
            "seconds": time.monotonic() - started,
        }
        (out / f"rank_{RANK}.json").write_text(json.dumps(result))
        raise
    (out / f"rank_{RANK}.json").write_text(json.dumps({"ok": True}))
    accelerator.end_training()


if __name__ == "__main__":
    main()

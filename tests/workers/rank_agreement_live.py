"""Worker for tests/training/test_rank_agreement_live.py: 2 processes under torchrun (gloo).

``python rank_agreement_live.py SCENARIO OUT_DIR``: both ranks construct equal Accelerators,
then SCENARIO changes a setting on one rank after construction (or keeps a rank away from a
collective) and the ranks go on to ``prepare``/``backward``/``save_state``/``load_state``/
``wait_for_everyone``. Each rank writes ``OUT_DIR/rank_<r>.json``: ``{"ok": true, ...}``
when it got through, else the error's type, message, attributes and the seconds since the
call that raised started; then it re-raises, so a rank that failed exits non-zero.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import kwplug
from kwplug.utils import ProjectConfiguration

RANK = int(os.environ["RANK"])


def out_file(out: Path, rank: int = RANK) -> Path:
    return out / f"rank_{rank}.json"


def train_step(accelerator: kwplug.Accelerator, model: torch.nn.Module) -> None:
    accelerator.backward(model(torch.ones(2, 4)).sum())


def scenario_steps(accelerator: kwplug.Accelerator, out: Path) -> Any:
    # Rank 1 changes gradient_accumulation_steps after construction, before prepare.
    if RANK == 1:
        accelerator.gradient_accumulation_steps = 4
    return accelerator.prepare(torch.nn.Linear(4, 4))


def scenario_steps_after_prepare(accelerator: kwplug.Accelerator, out: Path) -> Any:
    # ... after prepare: the first backward compares.
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    if RANK == 1:
        accelerator.gradient_accumulation_steps = 4
    train_step(accelerator, model)


def scenario_even_batches(accelerator: kwplug.Accelerator, out: Path) -> Any:
    if RANK == 1:
        accelerator.even_batches = False
    return accelerator.prepare(torch.nn.Linear(4, 4))


def scenario_naming(accelerator: kwplug.Accelerator, out: Path) -> Any:
    # Only rank 0 switches to automatic naming (after construction), then both save.
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    train_step(accelerator, model)
    if RANK == 0:
        accelerator.project_configuration.automatic_checkpoint_naming = True
    return accelerator.save_state(out / "explicit")


def scenario_total_limit_load(accelerator: kwplug.Accelerator, out: Path) -> Any:
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    train_step(accelerator, model)
    accelerator.save_state(out / "ckpt")
    if RANK == 1:
        accelerator.project_configuration.total_limit = 2
    return accelerator.load_state(out / "ckpt")


def wait_for_rank_0(out: Path) -> None:
    # A rank kept away from a collective: it waits for rank 0's verdict, then leaves.
    deadline = time.monotonic() + 60
    while not out_file(out, 0).exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def scenario_absent_barrier(accelerator: kwplug.Accelerator, out: Path) -> Any:
    # Rank 1 never reaches wait_for_everyone.
    if RANK == 1:
        return wait_for_rank_0(out)
    return accelerator.wait_for_everyone()


def scenario_absent_load(accelerator: kwplug.Accelerator, out: Path) -> Any:
    # Rank 1 never reaches load_state.
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    train_step(accelerator, model)
    accelerator.save_state(out / "ckpt")
    if RANK == 1:
        return wait_for_rank_0(out)
    return accelerator.load_state(out / "ckpt")


def scenario_absent_main(accelerator: kwplug.Accelerator, out: Path) -> Any:
    # Only rank 1 calls save_state: it must not wait for rank 0 beyond the bound.
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    train_step(accelerator, model)
    if RANK == 0:
        deadline = time.monotonic() + 60
        while not out_file(out, 1).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return None
    return accelerator.save_state(out / "ckpt")


def scenario_agree(accelerator: kwplug.Accelerator, out: Path) -> Any:
    # Equal settings, assigned after construction on both ranks; a save by the main process
    # alone (legal, with a warning) advances rank 0's iteration only, and the run goes on.
    accelerator.gradient_accumulation_steps = 2
    accelerator.even_batches = False
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    with accelerator.accumulate(model):
        train_step(accelerator, model)
    accelerator.project_configuration.automatic_checkpoint_naming = True
    accelerator.save_state()
    if RANK == 0:
        accelerator.save_state()  # KWPLUG_SAVE_STATE_WAIT is 1 s: the main process alone
    for _ in range(5):
        accelerator.wait_for_everyone()
    loaded = accelerator.load_state()
    with accelerator.accumulate(model):
        train_step(accelerator, model)
    return {
        "loaded": Path(loaded).parent.name,
        "iteration": accelerator.project_configuration.iteration,
    }


SCENARIOS = {
    name.removeprefix("scenario_"): function
    for name, function in globals().items()
    if name.startswith("scenario_")
}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    # construct_naming: only rank 0 asks for automatic naming at construction.
    naming = scenario == "construct_naming" and RANK == 0
    started = time.monotonic()
    try:
        accelerator = kwplug.Accelerator(
            cpu=True,
            project_config=ProjectConfiguration(
                project_dir=str(out / "project"), automatic_checkpoint_naming=naming
            ),
        )
        started = time.monotonic()
        got = SCENARIOS[scenario](accelerator, out) if scenario in SCENARIOS else None
    except Exception as exc:
        result = {
            "ok": False,
            "type": type(exc).__name__,
            "message": str(exc),
            "field": getattr(exc, "field", None),
            "values": list(getattr(exc, "values", ())),
            "missing": list(getattr(exc, "missing", ())),
            "waited_for": getattr(exc, "waited_for", None),
            "seconds": time.monotonic() - started,
        }
        out_file(out).write_text(json.dumps(result))
        raise
    result = {"ok": True, "got": got if isinstance(got, dict) else None}
    out_file(out).write_text(json.dumps(result))
    accelerator.end_training()


if __name__ == "__main__":
    main()

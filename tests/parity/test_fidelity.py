"""Issue 28, items 1-4: diffusers' checkpoint pattern (scripts/diffusers_style.py) in 2 gloo CPU
processes under Accelerate and, with only its imports renamed, under kwplug: ``save_state``
under ``if accelerator.is_main_process:`` (item 1: kwplug hung), pre-hooks calling the model's
``save_pretrained`` (item 2: kwplug passed DDP), ``from_pretrained(checkpoint, subfolder=
"unet")`` (item 3: kwplug kept it in its version folder), and a resume that skips the trained
batches itself (item 4: kwplug's loader had moved already, so they were skipped twice).
Compared: the batches each rank trained, the steps, the files the hooks wrote, the weights
reloaded from them and the final weights (``torch.equal``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import harness
import pytest
import torch

from kwplug.testing.distributed import run_torchrun

pytestmark = [pytest.mark.parity, pytest.mark.multiprocess, pytest.mark.timeout(900)]

SCRIPT = harness.SCRIPTS / "diffusers_style.py"
#: kwplug's rank 0 waits this long for the others before saving alone (KWPLUG_SAVE_STATE_WAIT).
WAIT = "2"


def _run(system: str, work: Path, name: str, *args: str) -> tuple[list[dict[str, Any]], str]:
    script = SCRIPT
    if system == "kwplug":
        script = work / "kwplug_diffusers_style.py"
        script.write_text(harness.rename_imports(SCRIPT.read_text()))
    record = work / name
    done = run_torchrun(
        [str(script), "--record", str(record), *args],
        nproc=2,
        timeout=150,
        env={"KWPLUG_SAVE_STATE_WAIT": WAIT, "ACCELERATE_USE_CPU": "1"},
        cwd=str(work),
    )
    assert done.returncode == 0, f"{system} {name}: exit {done.returncode}\n{done.stdout[-6000:]}"
    records = [json.loads(Path(f"{record}.rank{r}.json").read_text()) for r in range(2)]
    for r, rec in enumerate(records):
        rec["weights"] = torch.load(f"{record}.rank{r}.pt")
        rec["reloaded"] = {
            int(step): torch.load(f"{record}.ckpt{step}.pt") for step in rec["files"]
        }
    return records, done.stdout


def _same(ref: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
    for a, b in zip(ref, new, strict=True):
        assert b["trained"] == a["trained"]
        assert b["global_step"] == a["global_step"]
        assert b["files"] == a["files"]
        assert a["weights"].keys() == b["weights"].keys()
        assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
        assert a["reloaded"].keys() == b["reloaded"].keys()
        for step, state in a["reloaded"].items():
            assert all(torch.equal(state[k], b["reloaded"][step][k]) for k in state)


def _scenario(work: Path, system: str, shuffle: bool, style: str) -> dict[str, Any]:
    work.mkdir(parents=True)
    extra = ["--shuffle"] if shuffle else []
    first, out1 = _run(system, work, "first", "--output_dir", str(work / "out"), *extra)
    resumed, out2 = _run(
        system,
        work,
        "resumed",
        *("--output_dir", str(work / "resumed_out"), *extra),
        *("--resume_from_checkpoint", str(work / "out" / "checkpoint-8")),
        *("--resume_style", style),
    )
    return {"first": first, "resumed": resumed, "output": out1 + out2, "work": work}


@pytest.mark.parametrize(
    ("shuffle", "style"),
    [(False, "continue"), (False, "skip_first_batches"), (True, "skip_first_batches")],
    ids=["diffusers-continue", "skip_first_batches", "shuffled-skip_first_batches"],
)
def test_diffusers_checkpoint_pattern_matches_accelerate(
    tmp_path: Path, shuffle: bool, style: str
) -> None:
    ref = _scenario(tmp_path / "accelerate", "accelerate", shuffle, style)
    new = _scenario(tmp_path / "kwplug", "kwplug", shuffle, style)
    _same(ref["first"], new["first"])
    _same(ref["resumed"], new["resumed"])
    # In order, every batch of the 3 epochs trained once over the two runs (checkpoint at
    # step 8); shuffled, the resumed epoch's order is drawn afresh, as Accelerate's.
    for rank in range(2 if not shuffle else 0):
        before = new["first"][rank]["trained"][:8]
        after = new["resumed"][rank]["trained"]
        assert len(before) + len(after) == 18
        assert sorted(i for b in before + after for i in b) == sorted(
            i for b in new["first"][rank]["trained"] for i in b
        )
    # The hooks' folder is in the checkpoint directory itself (Accelerate's layout), the
    # second main-only save did not wait again, and rank 1 was told what it did not get.
    checkpoint = new["work"] / "out" / "checkpoint-8"
    assert (checkpoint / "unet" / "config.json").is_file()
    assert sorted(p.name for p in (checkpoint / "unet").iterdir()) == new["first"][0]["files"]["8"]
    assert new["output"].count("so the main process saves alone") == 2  # once per run
    assert "holds no rank_1.safetensors" in new["output"]

"""Issue 28, item 6: Accelerate's save/load log lines, at Accelerate's levels and in its words.

The same calls (scripts/state_log_lines.py: automatic naming with ``total_limit=1`` over three
``save_state()``, ``load_state()``, ``save_model`` whole and sharded) run under Accelerate in a
subprocess and under kwplug here, with caplog at INFO; between two calls, the lines of each
library are compared. Left out of Accelerate's, by name: the lines naming each file
Accelerate's ``save_state`` writes into its folder (kwplug writes other files, in its version
folder: a line naming a file that is not there would mislead), and the ``Loading the state of
... custom_checkpoint_<i>.pkl`` lines of a load of kwplug's own checkpoint (same reason). And
kwplug deletes over ``total_limit`` after the new checkpoint is committed, so its ``Deleting``
line comes after ``Saving current state to``, not before (docs/migrating-from-accelerate.md).
"""

from __future__ import annotations

import json
import logging
import re
import runpy
import subprocess
import sys
from pathlib import Path

import harness
import pytest

import kwplug
from kwplug.testing.distributed import child_environment
from kwplug.utils import ProjectConfiguration

pytestmark = [pytest.mark.parity]

#: Accelerate's lines that name the files it writes into a checkpoint folder.
FILE_LINES = re.compile(
    r"(Model weights|Optimizer state|Scheduler state|Random states|Gradient scaler state) "
    r"saved in .*/checkpoints/|Sampler state for dataloader|Saving the state of|"
    r"Loading the state of"
)
DELETING = re.compile(r"Deleting \d+ checkpoints to make room for new checkpoint\.")


def _segments(records: list[tuple[str, str, str]]) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    current = "before"
    for name, level, message in records:
        if name == "state_log_lines":
            current = message
            out[current] = []
        elif not FILE_LINES.search(message):
            out.setdefault(current, []).append((level, message))
    return out


def test_save_and_load_log_accelerates_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = harness.SCRIPTS / "state_log_lines.py"
    saved = tmp_path / "accelerate.json"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "accelerate"), str(saved)],
        env=child_environment({"ACCELERATE_USE_CPU": "1"}),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    reference = _segments([tuple(r) for r in json.loads(saved.read_text())])
    calls = runpy.run_path(str(script))["calls"]  # the same function, under kwplug
    with caplog.at_level(logging.INFO):
        calls(kwplug.Accelerator, ProjectConfiguration, tmp_path / "kwplug")
    records = [
        (r.name, r.levelname, r.getMessage())
        for r in caplog.records
        if r.name.startswith("kwplug") or r.name == "state_log_lines"
    ]
    mine = _segments(records)
    assert mine.keys() == reference.keys()
    assert sum(map(len, reference.values())) == 14  # what is compared: not nothing
    for call, expected in reference.items():
        got = [(level, m.replace("/kwplug/", "/accelerate/")) for level, m in mine[call]]
        assert sorted(got) == sorted(expected), call
        # In order, but for kwplug's Deleting line, logged after its save is committed.
        assert [g for g in got if not DELETING.search(g[1])] == [
            e for e in expected if not DELETING.search(e[1])
        ], call

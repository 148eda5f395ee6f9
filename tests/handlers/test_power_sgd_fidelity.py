"""PowerSGD in 2 processes trains to Accelerate's weights, bitwise.

The same script (tests/workers/power_sgd_fidelity.py, written against Accelerate) runs under
Accelerate and, with only its imports renamed, under kwplug. kwplug registers PowerSGD on its
canonical bucket view (what makes a resumed run bitwise an uninterrupted one); that view must
not change the numbers of an uninterrupted run: the same random first ``Q``, the same matrices,
the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from compat.compat_harness import rename_imports
from torchrun import torchrun

WORKER = Path(__file__).resolve().parents[1] / "workers" / "power_sgd_fidelity.py"

pytestmark = pytest.mark.timeout(400)


def _run(library: str, folder: Path) -> dict[str, Any]:
    script = folder / library / WORKER.name
    script.parent.mkdir()
    source = WORKER.read_text()
    script.write_text(source if library == "accelerate" else rename_imports(source, "kwplug"))
    result = torchrun(script, nproc=2, timeout=180, env={"ACCELERATE_USE_CPU": "1"})
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("POWER_SGD_RESULT ")]
    results: dict[str, Any] = json.loads(line.split(" ", 1)[1])
    return results


def test_power_sgd_weights_are_accelerates(tmp_path: Path) -> None:
    accelerate = _run("accelerate", tmp_path)
    kwplug = _run("kwplug", tmp_path)
    assert sorted(kwplug) == sorted(accelerate) == ["power_sgd", "power_sgd+fp16"]
    for name, theirs in accelerate.items():
        ours = kwplug[name]
        before, after = theirs["counters"]
        assert after < before / 10, (name, theirs["counters"])  # it did compress
        assert ours["counters"] == theirs["counters"], name
        assert ours["losses"] == theirs["losses"], name
        assert ours["digest"] == theirs["digest"], name

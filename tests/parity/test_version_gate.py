"""Issue 28, "What to build" item 2: a script that gates features on ``accelerate.__version__``
(diffusers registers its checkpoint hooks only from Accelerate 0.16 on) behaves under kwplug
as on the Accelerate release kwplug mirrors, once its bare ``import accelerate`` reads
``import kwplug.accelerate as accelerate`` (docs/migrating-from-accelerate.md); kwplug's own
``__version__`` is unchanged."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# diffusers' gates (train_unconditional.py, train_text_to_image.py...), as written there.
GATE = """
import json
import accelerate
from packaging import version
from accelerate import Accelerator

accelerator = Accelerator(cpu=True)
registered = []
if version.parse(accelerate.__version__) >= version.parse("0.16.0"):
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: None)
    registered.append("save")
if version.parse(accelerate.__version__) < version.parse("0.17.0"):
    registered.append("old")
print(json.dumps({"version": accelerate.__version__, "registered": registered,
                  "accelerator": type(accelerator).__name__}))
"""
FACE = "import kwplug.accelerate as accelerate"


def _run(source: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", source],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _ported(source: str, bare: str) -> str:
    source = source.replace("from accelerate import", "from kwplug import")
    return source.replace("import accelerate\n", bare + "\n")


def test_a_version_gate_behaves_as_on_the_mirrored_accelerate() -> None:
    pytest.importorskip("accelerate")
    theirs = _run(GATE)
    ours = _run(_ported(GATE, FACE))
    assert ours["registered"] == theirs["registered"] == ["save"]
    assert ours["version"] == theirs["version"]
    assert ours["accelerator"] == theirs["accelerator"] == "Accelerator"
    # `import kwplug as accelerate` reads kwplug's own version: the hook is never registered.
    assert _run(_ported(GATE, "import kwplug as accelerate"))["registered"] == ["old"]


def test_the_face_is_kwplug_with_the_mirrored_version() -> None:
    accelerate = pytest.importorskip("accelerate")
    import kwplug
    import kwplug.accelerate as face
    import kwplug.utils

    pinned = re.search(r"^accelerate==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert pinned is not None
    assert face.__version__ == face.ACCELERATE_VERSION == pinned.group(1) == accelerate.__version__
    assert kwplug.__version__ != face.__version__  # kwplug's own, from its metadata
    assert face.Accelerator is kwplug.Accelerator
    assert face.utils.ProjectConfiguration is kwplug.utils.ProjectConfiguration
    assert set(face.__all__) == set(kwplug.__all__) - {"__version__"}
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        face.not_a_name  # noqa: B018

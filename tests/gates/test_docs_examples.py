"""Every Python code block in README.md and docs/ runs, so examples cannot rot."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks() -> list[tuple[str, int, str]]:
    found = []
    for page in PAGES:
        for index, match in enumerate(BLOCK.finditer(page.read_text())):
            found.append((str(page.relative_to(ROOT)), index, match.group(1)))
    return found


@pytest.mark.parametrize(("page", "index", "code"), blocks(), ids=lambda v: str(v)[:40])
def test_code_block_runs(
    page: str, index: int, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if "# doctest: skip" in code:
        pytest.skip(
            "block marked '# doctest: skip': needs the package its page builds "
            "(tests/gates/test_tutorial.py installs it and runs these files)"
        )
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "block.py"
    script.write_text(code)
    runpy.run_path(str(script), run_name="__main__")

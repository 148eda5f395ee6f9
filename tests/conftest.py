from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest_plugins = ["kwplug.testing"]

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests in this process run as a plain single process, whatever the shell has set.
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("KWPLUG_DISABLE_PLUGIN_AUTOLOAD", raising=False)

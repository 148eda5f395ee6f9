"""``kwplug plugins --trackers``: every contributed tracker, its plugin and whether its package
is installed (with the install command when not)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from typing import Any, ClassVar

import pytest

from kwplug import cli, hookimpl
from kwplug.testing import PluginSandbox
from kwplug.tracking import GeneralTracker


class NeedsPackage(GeneralTracker):
    """A tracker whose (made-up) package is missing."""

    name: ClassVar[str] = "needs"
    requires_logging_directory: ClassVar[bool] = False
    requirement: ClassVar[str | None] = "kwplug-needs[client]"

    @classmethod
    def is_available(cls) -> bool:
        return False

    @property
    def tracker(self) -> None:
        return None


@hookimpl
def trackers() -> Mapping[str, Any]:
    return {"needs": NeedsPackage}


def test_trackers_are_listed_with_their_status(capsys: pytest.CaptureFixture[str]) -> None:
    with PluginSandbox() as sandbox:
        sandbox.add(__import__(__name__), distribution="kwplug-needs", name="needs")
        rows = {row["tracker"]: row for row in cli.tracker_rows()}
        assert cli.main(["plugins", "--trackers"]) == 0
        table = capsys.readouterr().out
        assert cli.main(["plugins", "--trackers", "--json"]) == 0
        parsed = json.loads(capsys.readouterr().out)
    assert {"jsonl", "tensorboard", "wandb", "mlflow", "aim", "needs"} <= set(rows)
    assert rows["needs"]["status"] == "missing"
    assert rows["needs"]["install"] == "pip install 'kwplug-needs[client]'"
    assert "kwplug-needs" in rows["needs"]["plugin"]
    assert "'wandb' (kwplug" in rows["wandb"]["plugin"]
    assert "'aim' (kwplug" in rows["aim"]["plugin"]
    aim_installed = importlib.util.find_spec("aim") is not None
    assert rows["aim"]["status"] == ("available" if aim_installed else "missing")
    assert rows["aim"]["install"] == ("" if aim_installed else "pip install 'kwplug[aim]'")
    assert rows["jsonl"]["status"] == "available" and rows["jsonl"]["install"] == ""
    assert table.splitlines()[0].split() == ["TRACKER", "PLUGIN", "STATUS", "INSTALL"]
    assert any(line.startswith("needs ") and "missing" in line for line in table.splitlines())
    assert parsed == sorted(parsed, key=lambda row: row["tracker"])

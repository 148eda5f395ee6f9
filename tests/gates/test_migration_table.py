"""Every public name of Accelerate's ``Accelerator``, ``accelerate.utils`` and ``accelerate``
has a row in docs/migrating-from-accelerate.md saying supported / differs / not supported, and
what a row calls supported exists in kwplug.

A name is in the table when a backtick span in the first cell of a row starts with it,
optionally qualified (```save_state(output_dir=None)```, ```accelerate.local_sgd.LocalSGD```):
a name only mentioned in the notes or as a keyword argument does not count.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kwplug
import kwplug.data_loader
import kwplug.hooks
import kwplug.launchers
import kwplug.local_sgd
import kwplug.logging
import kwplug.optimizer
import kwplug.scheduler
import kwplug.state
import kwplug.tracking
import kwplug.utils

DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-accelerate.md"
HEADER = "| Accelerate name | kwplug | Notes |"
STATUSES = ("supported", "differs", "not supported")
_SPAN = re.compile(r"`([^`]+)`")
_LEADING = re.compile(r"[A-Za-z_][\w.]*")


def _rows() -> Iterator[tuple[str, str, list[str], str]]:
    """(namespace, status, names, line) of each row of the name tables; the namespace is
    ``"utils"`` under the ``accelerate.utils`` heading, else ``"Accelerator"``."""
    in_table = False
    namespace = "Accelerator"
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            namespace = "utils" if "accelerate.utils" in line else "Accelerator"
        if line.strip() == HEADER:
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if in_table and not set(cells[0]) <= {"-", " "}:
            names = []
            for span in _SPAN.findall(cells[0]):
                match = _LEADING.match(span)
                if match:
                    names.append(match.group(0).rstrip(".").rsplit(".", 1)[-1])
            yield namespace, cells[1], names, line


def _top_level_names() -> set[str]:
    accelerate = pytest.importorskip("accelerate")
    return {
        name
        for name, value in vars(accelerate).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }


def _accelerate_names() -> tuple[set[str], set[str]]:
    accelerate = pytest.importorskip("accelerate")
    accelerate_utils = pytest.importorskip("accelerate.utils")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:  # instance attributes too: `scaler`, `step`, `log_with`...
        instance = vars(accelerate.Accelerator(cpu=True))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    members = {n for n in [*dir(accelerate.Accelerator), *instance] if not n.startswith("_")}
    utils = {
        name
        for name, value in vars(accelerate_utils).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    return members, utils


@pytest.fixture(scope="module")
def names() -> tuple[set[str], set[str]]:
    return _accelerate_names()


def test_every_row_has_a_status() -> None:
    rows = list(_rows())
    assert len(rows) > 50
    for _, status, names, line in rows:
        assert status in (*STATUSES, "kwplug only"), line
        assert names or status == "kwplug only", line


def test_every_accelerate_name_has_a_row(names: tuple[set[str], set[str]]) -> None:
    members, utils = names
    listed: dict[str, set[str]] = {"Accelerator": set(), "utils": set()}
    for namespace, status, row, _ in _rows():
        if status in STATUSES:
            listed[namespace].update(row)
    assert sorted(members - listed["Accelerator"]) == [], "Accelerator names without a row"
    assert sorted(utils - listed["utils"]) == [], "accelerate.utils names without a row"
    anywhere = listed["Accelerator"] | listed["utils"]
    assert sorted(_top_level_names() - anywhere) == [], "`accelerate` names without a row"


def test_names_claimed_supported_exist_in_kwplug(names: tuple[set[str], set[str]]) -> None:
    members, utils = names
    accelerator = kwplug.Accelerator(cpu=True)
    anywhere: list[Any] = [accelerator, kwplug, kwplug.utils, kwplug.tracking, kwplug.local_sgd]
    anywhere += [kwplug.optimizer, kwplug.scheduler, kwplug.logging, kwplug.state]
    anywhere += [kwplug.launchers, kwplug.data_loader, kwplug.hooks]
    missing = []
    for namespace, status, row, line in _rows():
        if status != "supported":
            continue
        for name in row:
            if namespace == "utils" and name in utils:
                found = hasattr(kwplug.utils, name)
            elif namespace == "Accelerator" and name in members:
                found = hasattr(accelerator, name)
            else:
                found = any(hasattr(space, name) for space in anywhere)
            if not found:
                missing.append(f"{name} ({line[:60]}...)")
    accelerator.end_training()
    assert missing == []

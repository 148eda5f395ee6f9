"""The shipped-scripts harness itself, without subprocesses: the rename, the check ids the
worker gives, how ranks' records merge and how two runs compare."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import compat_harness as harness
import pytest
from compat_harness import Outcome, ScriptRun

pytest.importorskip("accelerate")

_WORKER = Path(__file__).resolve().parents[1] / "workers" / "accelerate_script_checks.py"
_spec = importlib.util.spec_from_file_location("accelerate_script_checks", _WORKER)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
sys.modules["accelerate_script_checks"] = worker
_spec.loader.exec_module(worker)

SOURCE = '''"""from accelerate import Accelerator  (a docstring, not an import)"""
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.test_utils import RegressionModel
from accelerate.test_utils.testing import assert_exception
from accelerate.utils import (
    set_seed,
)
from accelerated import thing


def f():
    from accelerate.utils.operations import gather
'''


def test_rename_for_kwplug_touches_import_statements_only() -> None:
    renamed = harness.rename_imports(SOURCE, "kwplug")
    assert renamed.splitlines() == [
        '"""from accelerate import Accelerator  (a docstring, not an import)"""',
        "from kwplug import Accelerator",
        "from kwplug.state import AcceleratorState",
        "from compat_fixtures import RegressionModel",
        "from compat_fixtures import assert_exception",
        "from kwplug.utils import (",
        "    set_seed,",
        ")",
        "from accelerated import thing",
        "",
        "",
        "def f():",
        "    from kwplug.utils.operations import gather",
    ]


def test_rename_for_accelerate_replaces_the_fixtures_only() -> None:
    renamed = harness.rename_imports(SOURCE, "accelerate")
    expected = SOURCE.replace("accelerate.test_utils.testing", "compat_fixtures")
    assert renamed == expected.replace("accelerate.test_utils", "compat_fixtures")


def test_plain_import_of_accelerate_is_refused() -> None:
    with pytest.raises(ValueError, match="line 2"):
        harness.rename_imports("import os\nimport accelerate.utils\n", "kwplug")


def test_every_run_script_imports_after_the_rename() -> None:
    # a syntax or rename problem shows here, before any torchrun
    for script in harness.RUN:
        source = (harness.scripts_dir() / script.path).read_text()
        for library in ("kwplug", "accelerate"):
            renamed = harness.rename_imports(source, library)  # type: ignore[arg-type]
            assert "accelerate.test_utils" not in renamed
            compile(renamed, script.name, "exec")
        assert worker.called_checks(source), script.name


def test_called_checks_are_statement_calls_of_module_functions() -> None:
    source = (
        "def setup(): ...\ndef a(x): ...\ndef b(): ...\ndef helper(): ...\n"
        "def main():\n    acc = setup()\n    if acc:\n        a(1)\n    for i in range(2):\n"
        "        b()\n    a(2)\n    print('x')\n"
    )
    assert worker.called_checks(source) == ["a", "b"]


def test_labels_keep_plain_values_and_leave_objects_out() -> None:
    class Thing:
        pass

    assert worker.label("t", (Thing(), 3), {"flag": True}) == "t(3, flag=True)"
    assert worker.label("t", (Thing(),), {}) == "t"
    assert worker.label("t", ({"rank": 2},), {}) == "t({'rank': 2})"


def test_merge_marks_a_rank_without_a_record_as_killed() -> None:
    run = ScriptRun("kwplug", "s.py")
    records = {
        0: [
            {"check": "a", "status": "pass"},
            {"check": "b", "status": "timeout", "error": "no result"},
        ],
        1: [{"check": "a", "status": "pass"}],
    }
    assert harness._merge(run, records) is False  # type: ignore[arg-type]
    assert run.checks["a"].status == "pass"
    assert run.checks["b"].status == "timeout"
    assert run.checks["b"].ranks == {0: "timeout", 1: "killed"}


def test_compare_flags_what_passes_only_on_accelerate() -> None:
    reference = ScriptRun("accelerate", "s.py")
    reference.checks = {
        "a": Outcome("pass"),
        "b": Outcome("pass"),
        "c": Outcome("fail", "x"),
        "d": Outcome("pass"),
        "<main>": Outcome("pass"),
    }
    candidate = ScriptRun("kwplug", "s.py", stopped="<main> ValueError: v")
    candidate.checks = {"a": Outcome("pass"), "b": Outcome("error", "TypeError: t")}
    comparison = harness.compare(reference, candidate, {"s.py::d": "differs: because"})
    assert comparison.counts == (4, 3, 1)
    assert comparison.regressions == [
        "s.py::b: error: TypeError: t",
        "s.py::<main>: not run: <main> ValueError: v",
    ]
    assert comparison.stale == []
    candidate.checks["d"] = Outcome("pass")
    assert harness.compare(reference, candidate, {"s.py::d": "x"}).stale == ["s.py::d"]


def test_a_failing_statement_of_main_does_not_stop_the_checks_after_it() -> None:
    import ast

    source = "ran = []\ndef main():\n    ran.append(1)\n    1 / 0\n    ran.append(2)\n"
    namespace: dict[str, object] = {"_compat_main_failed": (failures := []).append}
    exec(compile(worker.guard_main(ast.parse(source)), "s.py", "exec"), namespace)
    namespace["main"]()  # type: ignore[operator]
    assert namespace["ran"] == [1, 2]
    assert [type(f) for f in failures] == [ZeroDivisionError]

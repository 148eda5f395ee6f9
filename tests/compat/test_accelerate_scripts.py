"""Issue 17, item 4: the checks of Accelerate's shipped test scripts pass on kwplug wherever
they pass on Accelerate, with only the scripts' imports renamed (tests/compat/README.md).

Each script in ``compat_harness.RUN`` runs once per library per session, in 2 CPU processes.
A check that passes under Accelerate and not on kwplug fails its script's test unless the
migration table's shipped-scripts section gives the reason, or ``pending.PENDING`` lists it
(work in progress on another branch). The failure message is the whole comparison.
"""

from __future__ import annotations

from pathlib import Path

import compat_harness as harness
import pytest
from compat_harness import RUN, SKIPPED, Library, Script, ScriptRun
from pending import PENDING

pytestmark = [pytest.mark.compat, pytest.mark.timeout(900)]

pytest.importorskip("accelerate")


class Runs:
    """Each (script, library) is run on first use and kept for the session."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.done: dict[tuple[str, Library], ScriptRun] = {}

    def get(self, script: Script, library: Library) -> ScriptRun:
        key = (script.path, library)
        if key not in self.done:
            self.done[key] = harness.run_script(script, library, self.work)
        return self.done[key]


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("accelerate-scripts"))


def test_every_shipped_script_runs_or_says_why_not() -> None:
    """A script a new accelerate release ships is run or skipped with a reason, never
    silently left out."""
    planned = {script.path for script in RUN} | set(SKIPPED)
    assert sorted(set(harness.installed_scripts()) - planned) == []
    assert sorted({script.path for script in RUN} & set(SKIPPED)) == []


@pytest.mark.parametrize("script", RUN, ids=[s.name for s in RUN])
def test_accelerate_reference(runs: Runs, script: Script) -> None:
    """The reference side is real: the renamed copy imports under Accelerate, its checks run
    on both ranks and some pass (a harness that records nothing compares nothing)."""
    reference = runs.get(script, "accelerate")
    assert "<import>" not in reference.checks, reference.output
    checks = [c for c in reference.checks if not c.startswith("<")]
    assert checks, reference.output
    assert any(reference.checks[c].status == "pass" for c in checks), reference.output
    assert all(len(reference.checks[c].ranks) == harness.NPROC for c in checks)


@pytest.mark.parametrize("script", RUN, ids=[s.name for s in RUN])
def test_kwplug_passes_what_accelerate_passes(runs: Runs, script: Script) -> None:
    reference = runs.get(script, "accelerate")
    candidate = runs.get(script, "kwplug")
    # nothing of Accelerate may run under kwplug's name (the fixtures are read, not imported)
    assert candidate.accelerate_imported is False, candidate.output
    allowed = {**harness.allowed_differences(), **PENDING}
    comparison = harness.compare(reference, candidate, allowed)
    table = harness.format_comparison(comparison)
    print(table)
    stale = comparison.stale
    unknown = [
        key
        for key in allowed
        if key.split("::", 1)[0] == script.name and key.split("::", 1)[1] not in reference.checks
    ]
    assert comparison.regressions == [] and stale == [] and unknown == [], "\n".join(
        [
            "checks that pass under Accelerate and not on kwplug, without a reason:",
            *comparison.regressions,
            "listed as failing (pending.py or the migration table) but passing (prune them):",
            *stale,
            "listed but not a check Accelerate ran:",
            *unknown,
            "",
            table,
            "--- kwplug output (tail) ---",
            candidate.output[-3000:],
        ]
    )


def test_the_stateful_checks_run_where_torchdata_is_installed(runs: Runs) -> None:
    """With torchdata (the test extra) test_distributed_data_loop's stateful checks pass under
    both libraries: use_stateful_dataloader=True is a StatefulDataLoader on kwplug too."""
    pytest.importorskip("torchdata")
    script = next(s for s in RUN if s.name == "test_distributed_data_loop.py")
    for library in ("accelerate", "kwplug"):
        checks = runs.get(script, library).checks
        for check in ("test_stateful_dataloader", "test_stateful_dataloader_save_state"):
            assert checks[check].status == "pass", (library, check, checks[check])


def test_the_join_checks_accelerate_runs_on_gpus_pass_on_kwplug(runs: Runs) -> None:
    """Accelerate's join_uneven_inputs works on GPUs only, so these checks fail under it on the
    CPU and are not compared; kwplug's works on gloo too, so they must pass -- the warning's
    text included, which the script asserts."""
    script = next(s for s in RUN if s.name == "test_distributed_data_loop.py")
    checks = runs.get(script, "kwplug").checks
    for check in (
        "test_can_join_uneven_inputs",
        "test_join_can_override_even_batches",
        "test_join_can_override_for_mixed_type_dataloaders",
        "test_join_raises_warning_for_iterable_when_overriding_even_batches",
    ):
        assert checks[check].status == "pass", (check, checks[check])

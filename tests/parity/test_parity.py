"""Issue 11's acceptance: Accelerate's examples, ported to local data, run under kwplug with
only their imports renamed, and behave as under Accelerate (tests/parity/README.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import harness
import pytest
from harness import SCENARIOS, Run, System

pytestmark = [pytest.mark.parity, pytest.mark.timeout(1800)]

#: Scripts whose kwplug runs are expected to match Accelerate's. The others are xfail (not
#: strict) until kwplug implements the Accelerator API they call; add a name when it passes.
KWPLUG_WORKING: frozenset[str] = frozenset(
    {
        "automatic_gradient_accumulation",
        "checkpointing",
        "complete_nlp_example",
        "cross_validation",
        "ddp_comm_hook",
        "early_stopping",
        "gradient_accumulation",
        "local_sgd",
        "memory",
        "multi_process_metrics",
        "nlp_example",
        "nlp_example_bf16",
        "profiler",
        "schedule_free",
        "tracking",
    }
)

PROCESSES = [1, pytest.param(2, marks=pytest.mark.multiprocess, id="2")]


class Runs:
    """Each (scenario, system, process count) is run once per session, on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[tuple[str, System, int], list[Run]] = {}

    def get(self, name: str, system: System, nproc: int) -> list[Run]:
        key = (name, system, nproc)
        if key not in self.done:
            scenario = SCENARIOS[name]
            if scenario.requires and importlib.util.find_spec(scenario.requires) is None:
                pytest.skip(f"{name} needs {scenario.requires!r}, not installed")
            work = self.root / f"{name}-{system}-{nproc}p"
            done = harness.run_scenario(scenario, system, nproc, work)
            if system == "accelerate" and any(run.failure() for run in done):
                # Accelerate's own 2-process runs sometimes abort at exit under load ("terminate
                # called without an active exception"); the reference is not what is under test,
                # so it gets one fresh retry. kwplug's runs never do.
                done = harness.run_scenario(
                    scenario, system, nproc, work.with_name(work.name + "-retry")
                )
            self.done[key] = done
        return self.done[key]


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("parity"))


def _succeeded(runs: list[Run], count: int) -> None:
    for run in runs:
        if (why := run.failure()) is not None:
            pytest.fail(why, pytrace=False)
    assert len(runs) == count


@pytest.mark.parametrize("nproc", PROCESSES)
@pytest.mark.parametrize("name", SCENARIOS)
def test_accelerate_reference(name: str, nproc: int, runs: Runs) -> None:
    """Under Accelerate the port runs, every rank records, the ranks' training batches cover
    the training split each epoch, the metric sees each evaluation sample exactly once (the
    same count as one process), and the ranks end with the same weights."""
    scenario = SCENARIOS[name]
    done = runs.get(name, "accelerate", nproc)
    _succeeded(done, len(scenario.runs))
    single = runs.get(name, "accelerate", 1)
    _succeeded(single, len(scenario.runs))
    for run, alone in zip(done, single, strict=True):
        assert [r["rank"] for r in run.records] == list(range(nproc))
        assert all(r["world_size"] == nproc for r in run.records)
        epochs = [r["epochs"] for r in run.records]
        assert len({len(e) for e in epochs}) == 1, "ranks saw different numbers of epochs"
        alone_epochs = alone.records[0]["epochs"]
        known = {i for epoch in alone_epochs for batch in epoch["train_ids"] for i in batch}
        for number, per_rank in enumerate(zip(*epochs, strict=True)):
            batches = [batch for epoch in per_rank for batch in epoch["train_ids"]]
            seen = {i for batch in batches for i in batch}
            if scenario.full_epochs:
                assert seen <= known, f"epoch {number}: samples from outside the training split"
            # (A run resumed mid-training starts at a different epoch than one process does.)
            if scenario.full_epochs and len(epochs[0]) == len(alone_epochs):
                # A dropped last batch may drop different samples than one process does.
                expected = {i for batch in alone_epochs[number]["train_ids"] for i in batch}
                slack = nproc * max(map(len, batches))
                assert len(seen) >= len(expected) - slack, f"epoch {number}: split not covered"
            gathered = {epoch["eval_gathered"] for epoch in per_rank}
            assert len(gathered) == 1, f"epoch {number}: ranks' metrics got {gathered} samples"
            if scenario.eval_counts_as_1p:
                assert gathered <= {e["eval_gathered"] for e in alone_epochs}, f"epoch {number}"
        assert run.records[0]["weights_sha256"], "no model recorded"
        # Data parallel training leaves every rank with the same weights.
        assert len({tuple(r["weights_sha256"]) for r in run.records}) == 1, "ranks' weights differ"


@pytest.mark.parametrize("nproc", PROCESSES)
@pytest.mark.parametrize("name", SCENARIOS)
def test_kwplug_matches_accelerate(
    name: str, nproc: int, runs: Runs, request: pytest.FixtureRequest
) -> None:
    """The renamed port under kwplug: same sample counts, same batches on every rank, same
    gathered evaluation counts and, where Accelerate's run is deterministic, the same weights
    bit for bit."""
    if name not in KWPLUG_WORKING:
        request.applymarker(
            pytest.mark.xfail(strict=False, reason="issue 11: Accelerator API not yet implemented")
        )
    scenario = SCENARIOS[name]
    reference = runs.get(name, "accelerate", nproc)
    _succeeded(reference, len(scenario.runs))
    candidate = runs.get(name, "kwplug", nproc)
    _succeeded(candidate, len(scenario.runs))
    weights = nproc == 1 or scenario.weights_2p
    for step, (ref, cand) in enumerate(zip(reference, candidate, strict=True)):
        problems = harness.compare(ref, cand, weights=weights)
        assert not problems, f"run {step}:\n" + "\n".join(problems[:20])


def test_an_exact_alias_of_accelerate_passes(runs: Runs, tmp_path: Path) -> None:
    """The harness end to end, on a control: a ``kwplug`` package that only re-exports
    Accelerate must give identical records and weights, so a kwplug failure means kwplug."""
    alias = tmp_path / "alias" / "kwplug"
    alias.mkdir(parents=True)
    for module, source in (
        ("__init__", "accelerate"),
        ("utils", "accelerate.utils"),
        ("local_sgd", "accelerate.local_sgd"),
    ):
        (alias / f"{module}.py").write_text(f"from {source} import *  # noqa: F403\n")
    name = "gradient_accumulation"
    reference = runs.get(name, "accelerate", 1)
    _succeeded(reference, 1)
    scenario = SCENARIOS[name]
    aliased = harness.run_scenario(
        scenario, "kwplug", 1, tmp_path / "run", pythonpath=[alias.parent]
    )
    _succeeded(aliased, 1)  # (the installed kwplug would fail: it lacks the API)
    assert harness.compare(reference[0], aliased[0], weights=True) == []

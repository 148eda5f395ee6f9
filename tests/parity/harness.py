"""Differential harness: run a ported Accelerate example under Accelerate and under kwplug.

The kwplug copy of a script is made by renaming its ``accelerate`` imports and nothing else
(:func:`rename_imports`), which is what kwplug's README promises. Each run records, per rank,
what the script saw (``scripts/_record.py``); :func:`compare` lists where two runs differ.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kwplug._process import forked as _forked
from kwplug.testing.distributed import (
    DistributedRunError,
    child_environment,
    run_bounded,
    run_torchrun,
    torchrun_command,
)

SCRIPTS = Path(__file__).resolve().parent / "scripts"
System = Literal["accelerate", "kwplug"]

#: Seconds one run may take before its process tree is killed (``PARITY_TIMEOUT`` overrides).
RUN_TIMEOUT = float(os.environ.get("PARITY_TIMEOUT", "180"))

# ``from accelerate import ...``, ``from accelerate.utils import ...``, ``from
# accelerate.local_sgd import ...`` and ``import accelerate`` at the start of a line (any
# indentation); nothing else in a script is touched.
_RENAMED_MODULES = ("", ".utils", ".local_sgd", ".tracking")
_IMPORT = re.compile(
    r"^(?P<indent>[ \t]*)(?:from[ \t]+accelerate(?P<sub>\.[\w.]+)?[ \t]+import\b"
    r"|import[ \t]+accelerate(?P<isub>\.[\w.]+)?\b)",
    re.MULTILINE,
)


def rename_imports(source: str) -> str:
    """``source`` with its ``accelerate`` imports renamed to ``kwplug`` (only import lines).

    Raises:
        ValueError: an import of an ``accelerate`` submodule other than ``utils`` or
            ``local_sgd``: kwplug promises no such module, so the port would not be a rename.
    """

    def rename(match: re.Match[str]) -> str:
        sub = match["sub"] if match["sub"] is not None else (match["isub"] or "")
        if sub not in _RENAMED_MODULES:
            raise ValueError(f"cannot rename import of accelerate{sub}: {match.group(0)!r}")
        return match.group(0).replace("accelerate", "kwplug", 1)

    return _IMPORT.sub(rename, source)


@dataclass(frozen=True)
class Scenario:
    """How a script is run for the comparison.

    Attributes:
        script: file name in ``scripts/`` without ``.py``.
        runs: argument lists run one after the other in the same work folder (a later run
            may resume from an earlier one's checkpoint); ``{work}`` is replaced by the
            folder. ``--cpu`` is added to each.
        env: extra environment variables for every run.
        requires: a module the script needs beyond the test extra (the test skips without it).
        weights_2p: whether Accelerate's 2-process weights are reproducible bitwise, so that
            kwplug's must equal them (at 1 process they always must).
        full_epochs: whether every epoch runs over the whole training split (not so when the
            script stops an epoch early), so that the ranks together must cover it.
        eval_counts_as_1p: whether the metric receives as many samples in 2 processes as in
            one (not so when the script evaluates a data loader it did not prepare).
        variant: the scenario's name when a script has several scenarios (default: the
            script's name).
    """

    script: str
    runs: tuple[tuple[str, ...], ...] = ((),)
    env: Mapping[str, str] = field(default_factory=dict)
    requires: str | None = None
    weights_2p: bool = True
    full_epochs: bool = True
    eval_counts_as_1p: bool = True
    variant: str | None = None

    @property
    def name(self) -> str:
        """The key of :data:`SCENARIOS`: ``variant``, else ``script``."""
        return self.variant or self.script


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("nlp_example"),
        # Issue 17: the forward is not inside accelerator.autocast(); prepare() must apply
        # bf16 to it (and convert the outputs to float32) as Accelerate's does.
        Scenario("nlp_example", runs=(("--mixed_precision=bf16",),), variant="nlp_example_bf16"),
        Scenario(
            "complete_nlp_example",
            runs=(
                (
                    "--with_tracking",
                    "--checkpointing_steps=epoch",
                    "--output_dir={work}/ckpt",
                    "--project_dir={work}/logs",
                ),
            ),
        ),
        Scenario("gradient_accumulation", runs=(("--gradient_accumulation_steps=4",),)),
        # PARITY_MAX_TRAIN_BATCH makes batches over 64 raise the CPU out-of-memory error, so
        # the batch size halves 256 -> 128 -> 64 and accumulation becomes 4 steps.
        Scenario("automatic_gradient_accumulation", env={"PARITY_MAX_TRAIN_BATCH": "64"}),
        Scenario(
            "checkpointing",
            runs=(
                ("--checkpointing_steps=40", "--output_dir={work}/ckpt"),
                ("--resume_from_checkpoint={work}/ckpt/step_40", "--output_dir={work}/resumed"),
            ),
        ),
        Scenario("multi_process_metrics"),
        Scenario("ddp_comm_hook", runs=(("--ddp_comm_hook=fp16",),)),
        Scenario("profiler", runs=(("--record_shapes",),)),
        Scenario("early_stopping", full_epochs=False),
        Scenario("local_sgd", runs=(("--gradient_accumulation_steps=2", "--local_sgd_steps=4"),)),
        # The original never prepares its test loader: every rank predicts the whole test set
        # and gather_for_metrics returns it once per rank (Accelerate's behaviour, kept).
        Scenario("cross_validation", eval_counts_as_1p=False),
        Scenario("memory", env={"PARITY_MAX_TRAIN_BATCH": "4"}),
        Scenario("tracking", runs=(("--with_tracking", "--project_dir={work}/logs"),)),
        Scenario("schedule_free", requires="schedulefree"),
    )
}


@dataclass
class Run:
    """One finished run: its command, exit status, output and per-rank records."""

    command: list[str]
    returncode: int
    output: str
    records: list[dict[str, Any]]

    def failure(self) -> str | None:
        """Why the run counts as failed, with the script's first traceback (torchrun's own
        report comes last and hides it) and the output's tail; None when it succeeded."""
        if self.returncode != 0:
            why = f"exit status {self.returncode}"
        elif not self.records:
            why = "no record written"
        else:
            return None
        start = self.output.find("Traceback (most recent call last)")
        first = f"--- first traceback ---\n{self.output[start:][:4000]}\n" if start >= 0 else ""
        return f"{why}: {' '.join(self.command)}\n{first}--- output tail ---\n{self.output[-3000:]}"


def script_for(scenario: Scenario, system: System, folder: Path) -> Path:
    """The script file ``system`` runs: the port itself, or its renamed copy in ``folder``."""
    original = SCRIPTS / f"{scenario.script}.py"
    if system == "accelerate":
        return original
    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / original.name
    copy.write_text(rename_imports(original.read_text()))
    return copy


def _single(
    target: Sequence[str], *, timeout: float, env: Mapping[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    """``python script *args`` as one process forked from the server that imported torch
    (``kwplug._process.forked``), stdout and stderr together."""
    with tempfile.TemporaryDirectory(prefix="parity-") as folder:
        done = _forked.run_single(
            "script",
            target[0],
            target[1:],
            env=env,
            timeout=timeout,
            folder=Path(folder),
            cwd=str(cwd),
        )
    if done.timed_out:
        raise DistributedRunError(f"timed out after {timeout:g} s\n{done.output[-8000:]}")
    return subprocess.CompletedProcess([sys.executable, *target], done.returncode, done.output)


def run_scenario(
    scenario: Scenario,
    system: System,
    nproc: int,
    work: Path,
    timeout: float = RUN_TIMEOUT,
    pythonpath: Sequence[Path] = (),
) -> list[Run]:
    """Run every step of ``scenario`` under ``system`` in ``nproc`` processes, in ``work``.

    One process runs the script with plain ``python``; more run it under torchrun (gloo on
    127.0.0.1, one thread per process). A run that times out has its process tree killed and
    counts as failed (exit status -9); later steps are not run after a failure. Folders in
    ``pythonpath`` come first on the scripts' import path.
    """
    work.mkdir(parents=True, exist_ok=True)
    script = script_for(scenario, system, work / "script")
    env = child_environment(
        {
            **scenario.env,
            # The renamed copy lives in ``work``; the helpers it imports stay in scripts/.
            "PYTHONPATH": os.pathsep.join(
                filter(None, [*map(str, pythonpath), str(SCRIPTS), os.environ.get("PYTHONPATH")])
            ),
            "ACCELERATE_USE_CPU": "1",
        }
    )
    runs: list[Run] = []
    for step, arguments in enumerate(scenario.runs):
        args = [a.replace("{work}", str(work)) for a in arguments] + ["--cpu"]
        out = work / f"record{step}"
        target = [str(script), *args]
        run_env = {**env, "PARITY_OUT": str(out)}
        command = [sys.executable, *target] if nproc == 1 else torchrun_command(target, nproc=nproc)
        try:
            if nproc == 1 and not _forked.forkable(run_env):
                done = run_bounded(command, timeout=timeout, env=run_env, cwd=str(work))
            elif nproc == 1:
                done = _single(target, timeout=timeout, env=run_env, cwd=work)
            else:
                done = run_torchrun(
                    target, nproc=nproc, timeout=timeout, env=run_env, cwd=str(work)
                )
                command = list(done.args)
            returncode, output = done.returncode, done.stdout
        except DistributedRunError as error:
            returncode, output = -9, str(error)
        records = sorted(
            (json.loads(p.read_text()) for p in work.glob(f"{out.name}.rank*.json")),
            key=lambda r: int(r["rank"]),
        )
        runs.append(Run(command, returncode, output, records))
        if runs[-1].failure():
            break
    return runs


def _epochs(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(record["epochs"])


def compare(reference: Run, candidate: Run, *, weights: bool) -> list[str]:
    """Where ``candidate`` differs from ``reference``: ranks, per-epoch sample counts, each
    rank's training and evaluation batches (sample ids, in order), the gathered evaluation
    count and, with ``weights``, the sha256 of every model's final weights."""
    problems: list[str] = []
    if len(reference.records) != len(candidate.records):
        return [f"{len(candidate.records)} rank records, expected {len(reference.records)}"]
    for ref, cand in zip(reference.records, candidate.records, strict=True):
        rank = ref["rank"]
        ref_epochs, cand_epochs = _epochs(ref), _epochs(cand)
        if len(ref_epochs) != len(cand_epochs):
            problems.append(f"rank {rank}: {len(cand_epochs)} epochs, expected {len(ref_epochs)}")
        for number, (r, c) in enumerate(zip(ref_epochs, cand_epochs, strict=False)):
            where = f"rank {rank} epoch {number}"
            for key in ("train_samples", "eval_gathered"):
                if r[key] != c[key]:
                    problems.append(f"{where}: {key} {c[key]}, expected {r[key]}")
            for key in ("train_ids", "eval_ids"):
                if r[key] != c[key]:
                    problems.append(f"{where}: {key} differ{_first_difference(r[key], c[key])}")
        if weights and ref["weights_sha256"] != cand["weights_sha256"]:
            problems.append(
                f"rank {rank}: final weights differ (sha256 of each model's state dict)"
            )
    return problems


def _first_difference(expected: Sequence[Any], got: Sequence[Any]) -> str:
    for index, (e, g) in enumerate(zip(expected, got, strict=False)):
        if e != g:
            return f" first at batch {index}: {g}, expected {e}"
    return f": {len(got)} batches, expected {len(expected)}"


def summary(run: Run) -> dict[str, Any]:
    """Per-rank sample counts per epoch, gathered evaluation counts and the final metric."""
    return {
        f"rank{r['rank']}": {
            "train_samples": [e["train_samples"] for e in _epochs(r)],
            "eval_gathered": [e["eval_gathered"] for e in _epochs(r)],
            "final_metric": r["final_metric"],
        }
        for r in run.records
    }

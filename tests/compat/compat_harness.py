"""Accelerate's shipped test scripts as kwplug's regression suite (issue 17, item 4).

The accelerate wheel installs its multi-process test scripts in
``accelerate/test_utils/scripts/``. Each script in :data:`RUN` is read from there at run time,
its imports are renamed (:func:`rename_imports`) into a temporary copy, and the copy runs in
2 CPU processes under torchrun (gloo) once against Accelerate and once against kwplug. The
worker (``tests/workers/accelerate_script_checks.py``) records every check ``main()`` calls,
per rank; :func:`compare` lines the two runs up check by check. See ``tests/compat/README.md``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kwplug.testing.distributed import (
    DistributedRunError,
    run_torchrun,
)

Library = Literal["accelerate", "kwplug"]
WORKER = Path(__file__).resolve().parents[1] / "workers" / "accelerate_script_checks.py"
DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-accelerate.md"
#: The module that stands in for ``accelerate.test_utils`` in both runs (compat_fixtures.py).
FIXTURES = "compat_fixtures"
#: Seconds one check may take on a rank before it counts as hung (``COMPAT_CHECK_TIMEOUT``).
CHECK_TIMEOUT = float(os.environ.get("COMPAT_CHECK_TIMEOUT", "20"))
#: Seconds one torchrun of a script may take (``COMPAT_RUN_TIMEOUT``).
RUN_TIMEOUT = float(os.environ.get("COMPAT_RUN_TIMEOUT", "240"))
#: torchruns of one script per library at most: a hung check ends a run, the next run skips
#: every check that already has a result.
MAX_RUNS = 3
NPROC = 2


@dataclass(frozen=True)
class Script:
    """A shipped script that runs here: ``path`` relative to ``test_utils/scripts``;
    ``stand_ins``: third-party modules it imports at the top but whose checks do not run on
    the CPU (replaced by a module whose functions raise, when not installed)."""

    path: str
    stand_ins: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return Path(self.path).name


RUN: tuple[Script, ...] = (
    Script("test_ops.py"),
    Script("test_sync.py"),
    Script("test_script.py"),
    Script("test_distributed_data_loop.py"),
    # datasets/evaluate/transformers serve test_mrpc only, which main() runs on a GPU only.
    Script("external_deps/test_metrics.py", stand_ins=("datasets", "evaluate", "transformers")),
)

#: Shipped scripts that do not run here, with the reason.
SKIPPED: dict[str, str] = {
    "test_ddp_comm_hook.py": (
        "its reference model is DDP(device_ids=[local_process_index]), which torch refuses for "
        "a CPU module: every check fails under Accelerate on the CPU (tests/handlers compares "
        "kwplug's hooks with torch's)"
    ),
    "test_notebook.py": (
        "notebook_launcher starts its own processes (it cannot run under torchrun) and sleeps "
        "through fault-tolerance scenarios for about a minute"
    ),
    "test_cli.py": "prints the number of GPUs; it has no check",
    "test_merge_weights.py": (
        "FSDP(1) sharded checkpoints merged through accelerate.commands.merge (the `accelerate "
        "merge-weights` command line), on a GPU"
    ),
    "external_deps/test_checkpointing.py": "downloads bert-base-cased and GLUE/MRPC from the Hub",
    "external_deps/test_performance.py": "Hub models and data sets, GPU accuracy thresholds",
    "external_deps/test_peak_memory_usage.py": "Hub models and CUDA memory statistics",
    "external_deps/test_pippy.py": "PiPPy pipeline parallelism on GPUs with Hub models",
    "external_deps/test_ds_multiple_model.py": "DeepSpeed",
    "external_deps/test_ds_alst_ulysses_sp.py": "DeepSpeed (ALST/Ulysses sequence parallelism)",
    "external_deps/test_zero3_integration.py": "DeepSpeed ZeRO-3",
}


def scripts_dir() -> Path:
    """``accelerate/test_utils/scripts`` of the installed accelerate (found, not imported)."""
    spec = importlib.util.find_spec("accelerate")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("accelerate (the test extra) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "test_utils" / "scripts"


def installed_scripts() -> list[str]:
    """Every shipped script, relative to :func:`scripts_dir` (``__init__.py`` left out)."""
    root = scripts_dir()
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("test_*.py") if p.is_file())


def rename_imports(source: str, library: Library, *, lenient: bool = False) -> str:
    """``source`` with its ``from accelerate... import`` statements renamed for ``library``.

    For kwplug, ``accelerate`` -> ``kwplug`` and ``accelerate.<sub>`` -> ``kwplug.<sub>`` (what
    the README promises a user has to change). For both libraries,
    ``accelerate.test_utils[.<sub>]`` -> :data:`FIXTURES`: the fixtures are the same test data
    on both sides. Only import statements found by :mod:`ast` are touched. ``lenient``
    (a diagnostic, never the test) imports kwplug's names from ``compat_lenient`` instead.

    Raises:
        ValueError: an ``import accelerate...`` statement (the renamed name would differ in
            the code that uses it, so no rename of the import line alone ports it).
    """
    lines = source.splitlines(keepends=True)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            if any(alias.name.split(".")[0] == "accelerate" for alias in node.names):
                raise ValueError(f"line {node.lineno}: `import accelerate` cannot be renamed")
            continue
        if not isinstance(node, ast.ImportFrom) or node.level or node.module is None:
            continue
        module = node.module
        if module.split(".")[0] != "accelerate":
            continue
        if module == "accelerate.test_utils" or module.startswith("accelerate.test_utils."):
            new = FIXTURES
        elif library == "kwplug":
            new = "compat_lenient" if lenient else "kwplug" + module[len("accelerate") :]
        else:
            continue
        line = lines[node.lineno - 1]
        pattern = re.compile(rf"(from\s+){re.escape(module)}(\s+import\b)")
        match = pattern.match(line, node.col_offset)
        if match is None:
            raise ValueError(f"line {node.lineno}: cannot find `from {module} import`")
        lines[node.lineno - 1] = (
            line[: match.start()] + match[1] + new + match[2] + line[match.end() :]
        )
    return "".join(lines)


@dataclass
class Outcome:
    """One check, over every rank: ``pass`` only when it passed on each."""

    status: str  # pass, fail, error, timeout, killed, not run
    error: str = ""
    ranks: dict[int, str] = field(default_factory=dict)


@dataclass
class ScriptRun:
    """What one library did with one script: the checks in the order they ran."""

    library: Library
    script: str
    checks: dict[str, Outcome] = field(default_factory=dict)
    stopped: str = ""  # why checks after the last one recorded did not run (import, main)
    accelerate_imported: bool | None = None
    runs: int = 0
    output: str = ""


def _read(out: Path) -> dict[int, list[dict[str, object]]]:
    records: dict[int, list[dict[str, object]]] = {}
    for rank in range(NPROC):
        path = out / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        records[rank] = [json.loads(line) for line in lines if line.strip()]
    return records


def _merge(run: ScriptRun, records: dict[int, list[dict[str, object]]]) -> bool:
    """Add one torchrun's records to ``run``; whether every rank reached its end."""
    per_check: dict[str, dict[int, dict[str, object]]] = {}
    order: list[str] = []
    for rank, lines in records.items():
        for record in lines:
            check = str(record["check"])
            if check == "<end>":
                imported = bool(record["accelerate_imported"])
                run.accelerate_imported = bool(run.accelerate_imported) or imported
                continue
            if check not in order:
                order.append(check)
            # a rank's first record is its check's result (an "aborted" one comes after it)
            per_check.setdefault(check, {}).setdefault(rank, record)
    for check in order:
        by_rank = per_check[check]
        ranks = {r: str(by_rank[r]["status"]) if r in by_rank else "killed" for r in records}
        bad = [r for r in sorted(ranks) if ranks[r] != "pass"]
        if check in ("<import>", "<main>") and bad:
            first = by_rank.get(bad[0], {})
            run.stopped = run.stopped or f"{check} {first.get('error', '')}"
        if not bad:
            run.checks[check] = Outcome("pass", "", ranks)
            continue
        worst = next((ranks[r] for r in bad if ranks[r] != "killed"), "killed")
        text = "; ".join(
            f"rank {r}: {by_rank[r].get('error', '')}"
            + (f" ({by_rank[r]['where']})" if by_rank[r].get("where") else "")
            if r in by_rank
            else f"rank {r}: stopped by torchrun after the other rank ended"
            for r in bad
        )
        run.checks[check] = Outcome(worst, text, ranks)
    return all(any(rec["check"] == "<end>" for rec in lines) for lines in records.values())


def run_script(script: Script, library: Library, work: Path, *, lenient: bool = False) -> ScriptRun:
    """Run ``script``'s checks against ``library`` in 2 processes, resuming after a hang."""
    folder = work / library / script.name.removesuffix(".py")
    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / script.name
    source = (scripts_dir() / script.path).read_text()
    copy.write_text(rename_imports(source, library, lenient=lenient))
    env = {"COMPAT_LIBRARY": library, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    if library == "accelerate":
        env["ACCELERATE_USE_CPU"] = "1"  # Accelerate's switch for CPU processes
    run = ScriptRun(library, script.name)
    for attempt in range(MAX_RUNS):
        out = folder / f"run{attempt}"
        out.mkdir()
        skip = folder / f"skip{attempt}.json"
        skip.write_text(json.dumps(sorted(run.checks)))
        target = [str(WORKER), "--script", str(copy), "--out", str(out), "--skip", str(skip)]
        target += ["--check-timeout", str(CHECK_TIMEOUT), "--stand-in", ",".join(script.stand_ins)]
        before = len(run.checks)
        try:
            result = run_torchrun(
                target, nproc=NPROC, timeout=RUN_TIMEOUT, env=env, cwd=str(folder)
            )
            run.output = result.stdout[-6000:]
        except DistributedRunError as error:
            run.output = str(error)[-6000:]
        run.runs += 1
        finished = _merge(run, _read(out))
        if finished or len(run.checks) == before:
            break
    return run


def allowed_differences() -> dict[str, str]:
    """``script::check`` -> reason, from the migration table's shipped-scripts section (rows
    of its ``| Script check | kwplug | Reason |`` table)."""
    rows: dict[str, str] = {}
    in_table = False
    for line in DOC.read_text().splitlines():
        if line.strip() == "| Script check | kwplug | Reason |":
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if in_table and not set(cells[0]) <= {"-", " "}:
            rows[cells[0].strip("`")] = f"{cells[1]}: {cells[2]}"
    return rows


@dataclass
class Comparison:
    """One script: the check-by-check lines, and what the test fails on."""

    script: str
    lines: list[tuple[str, str, str, str]]  # check, accelerate, kwplug, note
    regressions: list[str]  # passes on Accelerate, not on kwplug, no reason given
    stale: list[str]  # listed as an expected failure but passes on kwplug
    counts: tuple[int, int, int]  # checks Accelerate ran, Accelerate passes, kwplug passes


def compare(reference: ScriptRun, candidate: ScriptRun, allowed: Mapping[str, str]) -> Comparison:
    """Line up ``candidate`` (kwplug) with ``reference`` (Accelerate), check by check."""
    lines: list[tuple[str, str, str, str]] = []
    regressions: list[str] = []
    stale: list[str] = []
    names = list(reference.checks) + [c for c in candidate.checks if c not in reference.checks]
    passes = [0, 0]
    for check in names:
        if check == "<import>":
            continue
        ref = reference.checks.get(check, Outcome("not run", reference.stopped))
        new = candidate.checks.get(check, Outcome("not run", candidate.stopped))
        key = f"{reference.script}::{check}"
        if not check.startswith("<"):
            passes[0] += ref.status == "pass"
            passes[1] += ref.status == "pass" and new.status == "pass"
        note = new.error if new.status != "pass" else ""
        if ref.status == "pass" and new.status != "pass":
            if key in allowed:
                note = f"[allowed] {allowed[key]} -- {note}"
            else:
                regressions.append(f"{key}: {new.status}: {new.error}")
        elif key in allowed and new.status == "pass":
            stale.append(key)
        lines.append((check, ref.status, new.status, note))
    ran = sum(1 for c in reference.checks if not c.startswith("<"))
    return Comparison(reference.script, lines, regressions, stale, (ran, passes[0], passes[1]))


def format_comparison(comparison: Comparison) -> str:
    """A plain-text table of one script's comparison (printed by the test on failure)."""
    ran, ref, new = comparison.counts
    out = [f"{comparison.script}: Accelerate ran {ran} checks, passes {ref}; kwplug passes {new}"]
    width = max((len(line[0]) for line in comparison.lines), default=10)
    for check, ref_status, new_status, note in comparison.lines:
        out.append(f"  {check:<{width}}  {ref_status:<8} {new_status:<8} {note[:240]}")
    return "\n".join(out)


def main() -> None:
    """Print every script's comparison (``--lenient``: the diagnostic rename)."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lenient", action="store_true")
    parser.add_argument("scripts", nargs="*", help="file names (default: all of RUN)")
    args = parser.parse_args()
    allowed = allowed_differences()
    with tempfile.TemporaryDirectory() as work:
        for script in RUN:
            if args.scripts and script.name not in args.scripts:
                continue
            reference = run_script(script, "accelerate", Path(work))
            candidate = run_script(script, "kwplug", Path(work), lenient=args.lenient)
            print(format_comparison(compare(reference, candidate, allowed)), flush=True)


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()

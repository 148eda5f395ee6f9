"""Shared machinery of the benchmarks: interleaved timing, paired statistics, table and JSON.

Every benchmark compares up to three implementations of the same workload in one process run:
``raw`` (hand-written PyTorch, the physical floor), ``kwplug`` and ``accelerate`` (Hugging Face
Accelerate, only when it is installed -- the optional ``bench`` extra). Measurements are
interleaved (A B C, then C B A, ...), so slow drifts of the machine hit every implementation
alike, and reported as medians of per-repetition values and of *paired* ratios/differences
against ``raw`` from the same repetition.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: Implementations, in table order.
IMPLS: tuple[str, ...] = ("raw", "kwplug", "accelerate")

Samples = dict[str, list[float]]


def single_thread() -> None:
    """One intra-op thread (and one OpenMP thread in children), as every figure assumes."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


def accelerate_available() -> bool:
    """True when Hugging Face Accelerate can be imported (without importing it)."""
    return importlib.util.find_spec("accelerate") is not None


def child_env(**extra: str) -> dict[str, str]:
    """Environment of a child process: one OpenMP thread, this repository importable."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("PYTHONPATH", "")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": root + (os.pathsep + path if path else ""),
        **extra,
    }
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def make_accelerator(impl: str, **kwargs: Any) -> Any:
    """A CPU ``Accelerator(cpu=True, **kwargs)`` of ``impl`` (``"kwplug"`` or ``"accelerate"``;
    Accelerate's singletons are reset first, and its thread count set back to one)."""
    if impl == "kwplug":
        import kwplug

        return kwplug.Accelerator(cpu=True, **kwargs)
    import accelerate
    import torch
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True, **kwargs)
    torch.set_num_threads(1)
    return accelerator


# -- timing -----------------------------------------------------------------------------------


#: Environment variable choosing the clock of every timing (inherited by child processes):
#: ``wall`` (default, ``time.perf_counter``), ``cpu`` (``time.process_time``: this process's
#: CPU time, all threads) or ``thread`` (``time.thread_time``: the calling thread's CPU time;
#: in DDP that leaves out gloo's communication threads and keeps forward, backward, the hooks'
#: Python work and the optimizer). The CPU clocks are robust to other processes competing for
#: the cores; time spent blocked, e.g. waiting for the other DDP rank, is not counted.
CLOCK_ENV = "KWPLUG_BENCH_CLOCK"
CLOCKS = ("wall", "cpu", "thread")


def clock_name() -> str:
    """The clock in use (``wall`` or ``cpu``)."""
    name = os.environ.get(CLOCK_ENV, "wall") or "wall"
    if name not in CLOCKS:
        raise ValueError(f"{CLOCK_ENV} must be one of {CLOCKS}, got {name!r}")
    return name


def clock() -> Callable[[], float]:
    """``perf_counter``, ``process_time`` or ``thread_time`` (``time``), per :func:`clock_name`."""
    return {"wall": time.perf_counter, "cpu": time.process_time, "thread": time.thread_time}[
        clock_name()
    ]


def timed(fn: Callable[[int], object], n: int) -> float:
    """Seconds per iteration of ``fn(n)`` (which runs ``n`` iterations), on :func:`clock`.

    Garbage is collected before, and the collector paused during, the block (as ``timeit``).
    """
    now = clock()
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = now()
        fn(n)
        return (now() - start) / n
    finally:
        if enabled:
            gc.enable()


def block(fn: Callable[[int], object], n: int) -> Callable[[], float]:
    """A zero-argument block for :func:`interleave`: ``timed(fn, n)``."""
    return functools.partial(timed, fn, n)


def interleave(blocks: Mapping[str, Callable[[], float]], reps: int, warmup: int = 1) -> Samples:
    """Run each block once per repetition, the order rotating through every permutation.

    With two blocks that is A B, B A, A B, ...; with three, A B C, A C B, B A C, ... -- so each
    implementation runs equally often in each position (before/after each other one).

    Args:
        blocks: implementation name -> a callable that measures one block and returns its
            figure (e.g. seconds per step).
        reps: measured repetitions.
        warmup: unmeasured repetitions first (same alternation).

    Returns:
        implementation name -> the ``reps`` figures, in repetition order (so that index ``i``
        of two implementations forms a pair).
    """
    names = list(blocks)
    samples: Samples = {name: [] for name in names}
    # Move everything alive now (torch, its lazily imported modules, ...) out of the garbage
    # collector's sight, so that timed()'s collection before each block stays cheap.
    gc.collect()
    gc.freeze()
    orders = list(itertools.permutations(names))
    for rep in range(warmup + reps):
        order = orders[rep % len(orders)]
        for name in order:
            value = blocks[name]()
            if rep >= warmup:
                samples[name].append(value)
    return samples


def median(values: Sequence[float]) -> float:
    """The median (``statistics.median``)."""
    return float(statistics.median(values))


# -- results ----------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the three-way table.

    ``raw``/``kwplug``/``accelerate`` are the displayed medians (``None``: not run, or not
    applicable; a string: a short reason, e.g. an error). ``kwplug_vs_raw`` and
    ``accelerate_vs_raw`` are medians of paired throughput ratios (1.0 = as fast as raw
    PyTorch, higher is better); ``kwplug_extra``/``accelerate_extra`` are medians of paired
    differences to raw in ``extra_unit`` (e.g. microseconds per step). ``*_vs_raw_best`` is the
    same ratio between the *fastest* repetitions (``min`` raw / ``min`` other, as ``timeit``
    advises): outside interference only ever adds time, so on a shared machine it is the
    estimate least disturbed by other processes.
    """

    case: str
    unit: str
    raw: float | str | None = None
    kwplug: float | str | None = None
    accelerate: float | str | None = None
    kwplug_vs_raw: float | None = None
    accelerate_vs_raw: float | None = None
    kwplug_extra: float | None = None
    accelerate_extra: float | None = None
    kwplug_vs_raw_best: float | None = None
    accelerate_vs_raw_best: float | None = None
    extra_unit: str = ""
    note: str = ""

    def value(self, impl: str) -> float | str | None:
        """The displayed figure of ``impl``."""
        return getattr(self, impl)  # type: ignore[no-any-return]


def timing_row(
    case: str,
    samples: Samples,
    *,
    unit: str = "µs",
    scale: float = 1e6,
    rate: bool = False,
    note: str = "",
) -> Row:
    """A row from per-repetition *seconds per operation*.

    Args:
        case: what was measured.
        samples: implementation -> seconds per operation per repetition (paired by index).
        unit: displayed unit; ``scale`` converts seconds to it (ignored with ``rate``).
        scale: factor from seconds to ``unit`` (``1e6`` for µs, ``1e3`` for ms).
        rate: display operations per second instead of time per operation (``unit`` names
            the operation, e.g. ``"steps/s"``); the extra time is then in µs per operation.
        note: free text.
    """
    row = Row(case=case, unit=unit, note=note)
    extra_scale = 1e6 if rate else scale
    row.extra_unit = "µs" if rate else unit
    raw = samples.get("raw")
    for impl, values in samples.items():
        if not values:
            continue
        shown = 1.0 / median(values) if rate else median(values) * scale
        setattr(row, impl, shown)
        if raw and impl != "raw":
            pairs = list(zip(raw, values, strict=True))
            setattr(row, f"{impl}_vs_raw", median([r / v for r, v in pairs]))
            setattr(row, f"{impl}_vs_raw_best", min(raw) / min(values))
            setattr(row, f"{impl}_extra", median([(v - r) * extra_scale for r, v in pairs]))
    return row


@dataclass
class Target:
    """A goal of the issue, checked against a measured figure.

    ``op`` is ``"<="`` or ``">="``; ``met`` is ``None`` when the figure could not be measured.
    ``noise`` is the same figure for the run's A/A control (a second raw copy against raw),
    when there is one: a miss by less than the control's own deviation (from 1.0 for ratios,
    from 0 for extra time) is ``within_noise`` -- the run could not tell it from no difference.
    """

    name: str
    value: float | None
    op: str
    limit: float
    unit: str = ""
    met: bool | None = None
    noise: float | None = None
    within_noise: bool | None = None

    def __post_init__(self) -> None:
        if self.value is not None and self.met is None:
            self.met = self.value <= self.limit if self.op == "<=" else self.value >= self.limit
        if self.met is False and self.noise is not None and self.value is not None:
            if self.op == "<=":
                self.within_noise = self.value <= self.limit + abs(self.noise)
            else:
                self.within_noise = self.value >= self.limit - abs(1.0 - self.noise)

    @property
    def status(self) -> str:
        """``met``, ``MISSED``, ``missed within noise`` or ``n/a``."""
        if self.met is None:
            return "n/a"
        if self.met:
            return "met"
        return "missed within noise" if self.within_noise else "MISSED"


@dataclass
class Result:
    """What one benchmark reports: rows of the table, targets, checks and metadata."""

    benchmark: str
    quick: bool
    rows: list[Row] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict (each target with its ``status``)."""
        data = asdict(self)
        for target, entry in zip(self.targets, data["targets"], strict=True):
            entry["status"] = target.status
        return data


def meta() -> dict[str, Any]:
    """Versions and machine, recorded with every result."""
    import torch

    versions: dict[str, str | None] = {}
    for name in ("kwplug", "accelerate", "pluggy"):
        try:
            from importlib.metadata import version

            versions[name] = version(name)
        except Exception:
            versions[name] = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        **versions,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "clock": clock_name(),
        "loadavg_1_5_15min": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "machine": platform.machine(),
    }


# -- output -----------------------------------------------------------------------------------


def _fmt(value: float | str | None, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def _fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}x"


def _fmt_extra(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    text = f"{value:+,.0f}" if abs(value) >= 100 else f"{value:+.3g}"
    return f"{text} {unit}".rstrip()


def table_lines(rows: Sequence[Row], title: str = "") -> list[str]:
    """The rows as a Markdown table (``vs raw`` = paired throughput ratio, ``+`` = extra)."""
    header = [
        "case",
        "unit",
        "raw",
        "kwplug",
        "accelerate",
        "kwplug vs raw",
        "accelerate vs raw",
        "kwplug extra",
        "accelerate extra",
        "kwplug vs raw, best",
        "accelerate vs raw, best",
    ]
    body = [
        [
            row.case,
            row.unit,
            _fmt(row.raw),
            _fmt(row.kwplug),
            _fmt(row.accelerate),
            _fmt_ratio(row.kwplug_vs_raw),
            _fmt_ratio(row.accelerate_vs_raw),
            _fmt_extra(row.kwplug_extra, row.extra_unit),
            _fmt_extra(row.accelerate_extra, row.extra_unit),
            _fmt_ratio(row.kwplug_vs_raw_best),
            _fmt_ratio(row.accelerate_vs_raw_best),
        ]
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt_line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    lines = [f"### {title}", ""] if title else []
    lines.append(fmt_line(header))
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines.extend(fmt_line(line) for line in body)
    notes = [f"- {row.case}: {row.note}" for row in rows if row.note]
    if notes:
        lines += ["", *notes]
    return lines


def target_lines(targets: Sequence[Target]) -> list[str]:
    """The targets as a Markdown table with their status and the A/A control's figure."""
    lines = ["| target | measured | goal | A/A control | status |", "|---|---|---|---|---|"]
    for t in targets:
        control = "—" if t.noise is None else f"{_fmt(t.noise, 3)} {t.unit}"
        lines.append(
            f"| {t.name} | {_fmt(t.value, 4)} {t.unit} | {t.op} {_fmt(t.limit, 4)} {t.unit} "
            f"| {control} | {t.status} |"
        )
    return lines


def print_result(result: Result) -> None:
    """Print a benchmark's table, targets and checks."""
    title = (
        f"{result.benchmark}" + (" (quick)" if result.quick else "") + f", clock: {clock_name()}"
    )
    print("\n".join(table_lines(result.rows, title)))
    if result.targets:
        print()
        print("\n".join(target_lines(result.targets)))
    if result.checks:
        print()
        print("checks: " + json.dumps(result.checks, default=str))
    sys.stdout.flush()


def write_json(data: Any, path: str | None) -> None:
    """Write ``data`` as JSON to ``path``; to stdout when ``path`` is ``None`` or ``"-"``."""
    text = json.dumps(data, indent=2, default=str)
    if path is None or path == "-":
        print(text)
    else:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")


def parse_args(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``--quick`` and ``--json PATH`` (every benchmark's command line)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick", action="store_true", help="few, short repetitions (a smoke test, ~seconds)"
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="write the JSON result to PATH ('-' or omitted: print it after the table)",
    )
    parser.add_argument(
        "--clock",
        choices=CLOCKS,
        default=None,
        help="wall (default): elapsed time; cpu / thread: this process's / this thread's CPU "
        f"time, robust to other load on a shared machine (also settable with {CLOCK_ENV})",
    )
    parser.add_argument(
        "--no-accelerate",
        action="store_true",
        help="skip Hugging Face Accelerate even when it is installed",
    )
    return parser.parse_args(argv)


def run_main(
    name: str,
    description: str,
    run: Callable[[bool, bool], Result],
    argv: Sequence[str] | None = None,
) -> Result:
    """Command line of one benchmark: parse, run ``run(quick, with_accelerate)``, print, save."""
    args = parse_args(description, argv)
    if args.clock is not None:
        os.environ[CLOCK_ENV] = args.clock
    single_thread()
    with_accelerate = accelerate_available() and not args.no_accelerate
    result = run(args.quick, with_accelerate)
    result.meta = {**meta(), "accelerate_run": with_accelerate, **result.meta}
    print_result(result)
    write_json(result.to_json(), args.json)
    return result

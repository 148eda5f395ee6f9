"""The picture of a ``python -m benchmarks`` run: one PNG from the combined JSON.

Panels: per-step overhead over raw PyTorch (kwplug and Accelerate, µs per step, tiny model in
fp32 and bf16), start-up (import and first/repeated ``Accelerator()``), and -- when the run
holds 2-process DDP figures -- each communication hook's throughput relative to raw DDP.
Panels without data are left out.

matplotlib is imported only here, when a PNG is asked for (``pip install -e ".[bench]"``);
without it :func:`write_png` raises :class:`MissingMatplotlib` with the install command.

Run on a saved JSON: ``python -m benchmarks._plot RESULT.json [OUT.png]``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

IMPLS = ("kwplug", "accelerate")
COLOURS = {"raw": "#888888", "kwplug": "#1f77b4", "accelerate": "#ff7f0e"}


class MissingMatplotlib(RuntimeError):
    """matplotlib is not installed; the message says how to install it."""


def _rows(combined: dict[str, Any], benchmark: str) -> dict[str, dict[str, Any]]:
    result = combined.get("benchmarks", {}).get(benchmark, {})
    return {row["case"]: row for row in result.get("rows", [])}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _overhead(ax: Any, combined: dict[str, Any]) -> None:
    rows = _rows(combined, "step_overhead")
    cases = [c for c in ("tiny fp32 step", "tiny bf16 step") if c in rows]
    for offset, impl in enumerate(IMPLS):
        heights = [_number(rows[c].get(f"{impl}_extra")) for c in cases]
        xs = [i + (offset - 0.5) * 0.38 for i in range(len(cases))]
        bars = ax.bar(
            xs, [h or 0.0 for h in heights], 0.36, label=impl, color=COLOURS[impl], log=False
        )
        for bar, h in zip(bars, heights, strict=True):
            if h is not None:
                ax.annotate(f"{h:+.1f}", (bar.get_x() + bar.get_width() / 2, h), ha="center",
                            va="bottom" if h >= 0 else "top", fontsize=8)  # fmt: skip
    ax.axhline(0.0, color=COLOURS["raw"], linewidth=1, label="raw PyTorch (floor)")
    ax.set_xticks(range(len(cases)), [c.replace(" step", "") for c in cases])
    ax.set_ylabel("µs per step over raw PyTorch")
    ax.set_yscale("symlog", linthresh=10)
    ax.set_title("Per-step overhead (Linear 16→16)")
    ax.legend(fontsize=8)


def _startup(ax: Any, combined: dict[str, Any]) -> None:
    rows = _rows(combined, "construct_import")
    cases = [
        ("import (torch already imported)", "import", 1.0),
        ("first Accelerator(5 handlers)", "first Accelerator()", 1.0),
        ("repeated Accelerator(5 handlers)", "repeated Accelerator()", 1e-3),
    ]
    cases = [c for c in cases if c[0] in rows]
    for offset, impl in enumerate(IMPLS):
        # rows are in ms (import, first) and µs (repeated): all shown in ms
        heights = [(_number(rows[c].get(impl)) or 0.0) * scale for c, _, scale in cases]
        xs = [i + (offset - 0.5) * 0.38 for i in range(len(cases))]
        ax.bar(xs, heights, 0.36, label=impl, color=COLOURS[impl])
    ax.set_xticks(range(len(cases)), [label for _, label, _ in cases], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms (log scale)")
    ax.set_title("Start-up")
    ax.legend(fontsize=8)


def _hooks(ax: Any, combined: dict[str, Any]) -> None:
    rows = _rows(combined, "ddp_2proc")
    cases = [c for c in rows if c.startswith("ddp 2proc")]
    for offset, impl in enumerate(IMPLS):
        ratios = [_number(rows[c].get(f"{impl}_vs_raw")) or 0.0 for c in cases]
        xs = [i + (offset - 0.5) * 0.38 for i in range(len(cases))]
        ax.bar(xs, ratios, 0.36, label=impl, color=COLOURS[impl])
    ax.axhline(1.0, color=COLOURS["raw"], linewidth=1, label="raw DDP, same hook")
    labels = [c.split("hook=")[-1] for c in cases]
    ax.set_xticks(range(len(cases)), labels, fontsize=8, rotation=20)
    ax.set_ylabel("steps/s vs raw DDP (x)")
    ax.set_title("2-process DDP hooks (loopback)")
    ax.legend(fontsize=8)


def panels(combined: dict[str, Any]) -> list[Callable[[Any, dict[str, Any]], None]]:
    """The panel functions that have data in ``combined``, in display order."""
    chosen: list[Callable[[Any, dict[str, Any]], None]] = []
    if _rows(combined, "step_overhead"):
        chosen.append(_overhead)
    if _rows(combined, "construct_import"):
        chosen.append(_startup)
    if any(c.startswith("ddp 2proc") for c in _rows(combined, "ddp_2proc")):
        chosen.append(_hooks)
    return chosen


def write_png(combined: dict[str, Any], path: str) -> str:
    """Draw the panels of ``combined`` (the JSON ``python -m benchmarks`` writes) into the PNG
    at ``path``; return ``path``.

    Raises:
        MissingMatplotlib: matplotlib is not installed.
        ValueError: no benchmark in ``combined`` has a panel.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingMatplotlib(
            'the benchmark PNG needs matplotlib: pip install -e ".[bench]" (or pip install '
            "matplotlib); the JSON and the tables do not"
        ) from exc
    chosen = panels(combined)
    if not chosen:
        raise ValueError("nothing to plot: no step_overhead, construct_import or ddp_2proc rows")
    fig, axes = plt.subplots(1, len(chosen), figsize=(5.2 * len(chosen), 4.2), squeeze=False)
    for ax, draw in zip(axes[0], chosen, strict=True):
        draw(ax, combined)
    meta = combined.get("meta", {})
    fig.suptitle(
        "kwplug vs raw PyTorch vs Accelerate"
        + (" (quick)" if combined.get("quick") else "")
        + (f" -- torch {meta['torch']}" if "torch" in meta else "")
        + (f", load {meta['loadavg_1_5_15min'][0]:.1f}" if meta.get("loadavg_1_5_15min") else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks._plot RESULT.json [OUT.png]`` (default: the JSON's name, .png)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or len(args) > 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as handle:
        combined = json.load(handle)
    out = args[1] if len(args) == 2 else args[0].rsplit(".", 1)[0] + ".png"
    try:
        print(write_png(combined, out))
    except MissingMatplotlib as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""PNG plots of the end-to-end rows (matplotlib's Agg canvas; imported only here).

Every plot has one panel per producer shape (a kept tensor, a fresh one) with one
consumer, against size, and one for fan-out (the kept tensor of the fan-out size, to 1
and to k consumers) against consumers; with `--hosts 2` the titles say so. One line
per path, the same colour in every plot: rdt's solid, Ray's dashed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ._units import human

Row = dict[str, Any]


def plot_e2e(rows: list[Row], out_dir: str) -> list[str]:
    """Write e2e_throughput.png, e2e_latency.png and loop_stall.png under `out_dir`; return their paths.

    Raises: ImportError where matplotlib is not installed.
    """
    import matplotlib  # noqa: F401  (the ImportError callers catch)

    e2e = [r for r in rows if r["bench"] == "e2e" and "seconds" in r]
    if not e2e:
        return []
    cases = list(dict.fromkeys(r["case"] for r in e2e))
    written = []
    for name, title, y, ylabel, ylog in (
        ("e2e_throughput.png", "Throughput, from the producing call until every byte is read",
         lambda r: r["size"] * r["consumers"] / r["seconds"] / 1e9, "GB/s (all consumers together)", False),
        ("e2e_latency.png", "Latency, from the producing call until every byte is read",
         lambda r: r["seconds"] * 1e3, "ms (warm median)", True),
        ("loop_stall.png", "The consumer's event-loop stall while the value arrives",
         lambda r: None if r.get("loop_stall_ms") is None else max(r["loop_stall_ms"], 0.01),
         "ms (worst warm pass)", True),
    ):
        path = os.path.join(out_dir, name)
        _figure(e2e, cases, title, y, ylabel, ylog, path)
        written.append(path)
    return written


def _panels(rows: list[Row]) -> list[tuple[str, str, list[Row]]]:
    """(title, x key, rows) per panel: each shape against size, then fan-out against consumers."""
    panels = []
    for hosts in sorted({r.get("hosts", 1) for r in rows}):
        where = ", across hosts" if hosts == 2 else ""
        mine = [r for r in rows if r.get("hosts", 1) == hosts]
        for shape in dict.fromkeys(r["shape"] for r in mine):
            one = [r for r in mine if r["shape"] == shape and r["consumers"] == 1]
            if one:
                panels.append((f"{shape} tensor, 1 consumer{where}", "size", one))
        fanned = [r for r in mine if r["consumers"] > 1]
        if fanned:
            size = max(r["size"] for r in fanned)
            fan = [r for r in mine if r["shape"] == "kept" and r["size"] == size]
            panels.append((f"kept {human(size)} to k consumers{where}", "consumers", fan))
    return panels


def _figure(rows: list[Row], cases: list[str], title: str, y: Callable[[Row], float | None], ylabel: str,
            ylog: bool, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    panels = _panels(rows)
    fig = Figure(figsize=(4.6 * len(panels) + 2.8, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    colours = {case: f"C{i % 10}" for i, case in enumerate(cases)}
    lines: dict[str, Any] = {}
    missing: set[str] = set()
    for ax, (panel, x, mine) in zip(axes, panels):
        for case in cases:
            points = sorted((r[x], y(r)) for r in mine if r["case"] == case)
            points = [(a, b) for a, b in points if b is not None]
            if not points:
                missing.update(r["case"] for r in mine if r["case"] == case)
                continue
            (line,) = ax.plot(*zip(*points), marker="o", color=colours[case],
                              linestyle="-" if case.startswith("rdt ") else "--", label=case)
            lines.setdefault(case, line)
        xs = sorted({r[x] for r in mine})
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [human(v) if x == "size" else str(v) for v in xs])
        ax.minorticks_off()
        if ylog:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("bytes" if x == "size" else "consumers")
        ax.set_ylabel(ylabel)
        ax.set_title(panel, fontsize="medium")
        ax.grid(True, which="major", alpha=0.3)
    fig.suptitle(title)
    missing -= set(lines)
    if missing:
        fig.supxlabel("not shown (sync consumer, no loop): " + ", ".join(sorted(missing)), fontsize="small")
    fig.legend([lines[c] for c in cases if c in lines], [c for c in cases if c in lines],
               loc="outside right upper", fontsize="small")
    fig.savefig(path, dpi=110)

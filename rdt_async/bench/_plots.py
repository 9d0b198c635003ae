"""PNG plots of the end-to-end rows (matplotlib's Agg canvas; imported only here).

One plot per figure, each readable at the width of a docs page: for each measure
(throughput, latency, the consumer's loop stall), one figure per producer shape with one
consumer against size (`e2e_throughput-kept.png`, `...-fresh.png`), and one for fan-out
against consumers (`...-fanout.png`); `-hosts2` where the consumers ran on a second host.
Every axis of values is logarithmic (4 KiB and 256 MiB on one axis). One line per path,
the same colour in every plot: rdt's solid, Ray's dashed, the physical limit dotted black.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ._units import human

Row = dict[str, Any]
LIMIT = "physical limit"  # (as _e2e.LIMIT: this module imports neither Ray nor torch)
MEASURES: tuple[tuple[str, str, Callable[[Row], float | None], str], ...] = (
    ("e2e_throughput", "Throughput, from the producing call until every byte is read",
     lambda r: r["size"] * r["consumers"] / r["seconds"] / 1e9, "GB/s (all consumers together)"),
    ("e2e_latency", "Latency, from the producing call until every byte is read",
     lambda r: r["seconds"] * 1e3, "ms (warm median)"),
    ("loop_stall", "The consumer's event-loop stall while the value arrives",
     lambda r: None if r.get("loop_stall_ms") is None else max(r["loop_stall_ms"], 0.01), "ms (worst warm pass)"),
)


def plot_e2e(rows: list[Row], out_dir: str) -> list[str]:
    """Write one PNG per (measure, panel) under `out_dir`; return their paths.

    Raises: ImportError where matplotlib is not installed.
    """
    import matplotlib  # noqa: F401  (the ImportError callers catch)

    e2e = [r for r in rows if r["bench"] == "e2e" and "seconds" in r]
    if not e2e:
        return []
    cases = list(dict.fromkeys(r["case"] for r in e2e))
    written = []
    for measure, title, y, ylabel in MEASURES:
        for suffix, panel, x, mine in panels(e2e):
            path = os.path.join(out_dir, f"{measure}-{suffix}.png")
            _figure(mine, cases, f"{title}\n{panel}", x, y, ylabel, path)
            written.append(path)
    return written


def panels(rows: list[Row]) -> list[tuple[str, str, str, list[Row]]]:
    """(file suffix, title, x key, rows) per plot: each shape against size, then fan-out against consumers."""
    out = []
    for hosts in sorted({r.get("hosts", 1) for r in rows}):
        where, tag = (", consumers on a second host", "-hosts2") if hosts == 2 else ("", "")
        mine = [r for r in rows if r.get("hosts", 1) == hosts]
        for shape in dict.fromkeys(r["shape"] for r in mine):
            one = [r for r in mine if r["shape"] == shape and r["consumers"] == 1]
            if one:
                out.append((f"{shape}{tag}", f"{shape} tensor, 1 consumer{where}", "size", one))
        fanned = [r for r in mine if r["consumers"] > 1]
        if fanned:
            size = max(r["size"] for r in fanned)
            fan = [r for r in mine if r["shape"] == "kept" and r["size"] == size]
            out.append((f"fanout{tag}", f"kept {human(size)} to k consumers{where}", "consumers", fan))
    return out


def _style(case: str, colour: str) -> dict[str, Any]:
    if case == LIMIT:
        return {"color": "black", "linestyle": ":", "linewidth": 2.5, "marker": None, "zorder": 3}
    if case.startswith("rdt "):
        return {"color": colour, "linestyle": "-", "linewidth": 2, "marker": "o"}
    return {"color": colour, "linestyle": "--", "linewidth": 1.5, "marker": "s", "markersize": 5}


def _figure(rows: list[Row], cases: list[str], title: str, x: str, y: Callable[[Row], float | None],
            ylabel: str, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig = Figure(figsize=(8, 5), layout="constrained")  # 880x550 px: labels ~14 px tall on a docs page
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    colours = {case: f"C{i % 10}" for i, case in enumerate(c for c in cases if c != LIMIT)}
    shown, missing = [], []
    for case in cases:
        points = sorted((r[x], y(r)) for r in rows if r["case"] == case)
        points = [(a, b) for a, b in points if b is not None]
        if not points:
            if any(r["case"] == case for r in rows):
                missing.append(case)
            continue
        (line,) = ax.plot(*zip(*points), label=case, **_style(case, colours.get(case, "black")))
        shown.append(line)
    xs = sorted({r[x] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [human(v) if x == "size" else str(v) for v in xs])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("bytes per object" if x == "size" else "consumers of one object")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    if missing:
        fig.supxlabel("not shown (a sync consumer: no loop): " + ", ".join(missing), fontsize="small")
    if shown:
        fig.legend(handles=shown, loc="outside right upper", fontsize="small")
    fig.savefig(path, dpi=110)

"""Sizes as people write them (4K, 64M, 1G) and as they read them; the results as JSON and Markdown."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import IO, Any

from ._units import human


def write_json(result: dict[str, Any], path: str) -> IO[str]:
    """Write `result` to `path` ('-': stdout); return where the table goes (the other stream)."""
    text = json.dumps(result, indent=2)
    if path == "-":
        print(text)
        return sys.stderr
    with open(path, "w") as f:
        f.write(text + "\n")
    return sys.stdout


def markdown(result: dict[str, Any]) -> str:
    """The run as Markdown: the end-to-end tables, then every other bench's rows, then the checks."""
    rows = result["rows"]
    machine = ", ".join(f"{k} {v}" for k, v in result.get("machine", {}).items())
    out = [f"# rdt_async bench, {result.get('when', '')}", "", machine]
    if result.get("command"):
        out[-1] += f"; `{result['command']}`"
    e2e = [r for r in rows if r["bench"] == "e2e"]
    if e2e:
        across = " Consumers on a second host." if any(r.get("hosts", 1) == 2 for r in e2e) else ""
        out += ["", "## End to end", "",
                "From the producing call until the consumer has read every element: warm median "
                f"(ratio to the best Ray path of this run), then the first pass (cold).{across} "
                "`physical limit` (one node): the same calls, the producer's own work (a kept "
                "shared tensor: none; a kept plain one: one warm copy into shared memory, by the "
                "fastest copy it knows at that size, `limit_copy` in the JSON; a fresh one: its "
                "allocation and that copy) and one read of every byte, nothing else. "
                f"Shapes: {SHAPES_SAID} One table per producer shape: a page shows every column.",
                *_by_shape(e2e, _time_cell)]
        under = under_the_limit(e2e)
        if under:
            out += ["", "**Under the physical limit** (suspicious: the limit is meant to be the least a pass "
                    "can cost here, so either it missed a faster way or these passes skipped work; check "
                    "before trusting either): " + ", ".join(f"{k} ({v:.2f}x)" for k, v in under.items()) + "."]
        if any(r.get("loop_stall_ms") is not None for r in e2e):
            out += ["", "The consumer's event-loop stall while the value arrived, worst warm pass, ms "
                    "(—: a sync actor, Ray 2.60's RDT consumer: no loop; its other calls wait until the value is in):",
                    *_by_shape(e2e, _stall_cell)]
    for bench in dict.fromkeys(r["bench"] for r in rows if r["bench"] != "e2e"):
        out += ["", f"## {bench}", "", rows_table([r for r in rows if r["bench"] == bench])]
    if result.get("checks"):
        out += ["", "## Checks", "", "| check | value |", "| --- | --- |"]
        out += [f"| {k} | {v} |" for k, v in result["checks"].items()]
    return "\n".join(out) + "\n"


# (as the e2e docstring says; this module imports neither Ray nor torch)
SHAPES_SAID = ("`kept` (the producer called `share_memory_()` once), `plain` (it keeps a tensor it never "
               "shared: rdt's shm and Ray's object store copy a snapshot of it at each return; tcp, nixl, "
               "ucxx and gloo serve the live tensor at the fetch, rdt's object_store copies it then), "
               "`fresh` (a new tensor each call).")


def under_the_limit(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The e2e rows faster than the physical limit of their column (`vs_limit` < 1), by
    "case shape size[ to k]": the limit is meant to be a floor, so each is suspect."""
    return {f"{r['case']} {r['shape']} {human(r['size'])}" + (f" to {r['consumers']}" if r["consumers"] > 1 else ""):
            round(r["vs_limit"], 3) for r in rows if r.get("bench") == "e2e" and r.get("vs_limit", 1.0) < 1.0}


def _by_shape(rows: list[dict[str, Any]], cell: Callable[[dict[str, Any]], str]) -> list[str]:
    """Markdown lines: an e2e table per producer shape (as run: kept, plain, fresh), each after a blank line;
    a path that failed at a shape is said under that shape's table, one that did not run
    (or failed at a shape no path ran) under the first only."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows if "seconds" in r))
    if not shapes:  # no path ran: the rows that say why
        return ["", e2e_table(rows, cell)]
    out = []
    for i, shape in enumerate(shapes):
        mine = [r for r in rows if r.get("shape") == shape or (i == 0 and r.get("shape") not in shapes)]
        out += ["", e2e_table(mine, cell)]
    return out


def e2e_table(rows: list[dict[str, Any]], cell: Callable[[dict[str, Any]], str]) -> str:
    """One row per path, one column per (shape, consumers, size); failed paths say why."""
    done = [r for r in rows if "seconds" in r]
    shapes = list(dict.fromkeys(r["shape"] for r in done))  # as run: kept, plain, fresh
    cols = sorted({(r["shape"], r["consumers"], r["size"]) for r in done}, key=lambda c: (shapes.index(c[0]), *c[1:]))
    head = [f"{s} {human(z)}" + (f" to {k}" if k > 1 else "") for s, k, z in cols]
    out = ["| path | " + " | ".join(head) + " |", "| --- |" + " --- |" * len(cols)]
    by = {(r["case"], r["shape"], r["consumers"], r["size"]): r for r in done}
    for case in dict.fromkeys(r["case"] for r in done):
        cells = [cell(by[(case, *c)]) if (case, *c) in by else "" for c in cols]
        out.append(f"| {case} | " + " | ".join(cells) + " |")
    for r in rows:
        where = f" at {r['shape']} {human(r['size'])}" + (f" to {r['consumers']}" if r.get("consumers", 1) > 1 else "") \
            if "shape" in r and "size" in r else ""
        if "error" in r:
            out.append(f"| {r['case']} | failed{where}: {r['error'].splitlines()[0][:160]} |")
        elif "skipped" in r:
            out.append(f"| {r['case']} | not run: {r['skipped']} |")
        elif "broke" in r:
            n = r.get("passes", 0)
            out.append(f"| {r['case']} | broke{where} after {n} warm pass{'' if n == 1 else 'es'}, left out from then "
                       f"on: {r['broke'].splitlines()[0][:160]} |")
    return "\n".join(out)


def _time_cell(r: dict[str, Any]) -> str:
    cell = f"{r['seconds'] * 1e3:.3g} ms"
    if "vs_best_ray" in r:
        cell += f" ({r['vs_best_ray']:.2f}x)"
    if "cold_s" in r:
        cell += f", cold {r['cold_s'] * 1e3:.3g}"
    return cell


def _stall_cell(r: dict[str, Any]) -> str:
    stall = r.get("loop_stall_ms")
    return "—" if stall is None else f"{stall:.3g}"


RAW = ("passes_s", "turns")  # every pass's time and the path's place in each round: the JSON's, not the tables'


def rows_table(rows: list[dict[str, Any]]) -> str:
    """Rows of one bench as a Markdown table: case, size, then every other field (but RAW's)."""
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in ("bench", "case", "size", *RAW)]
    out = ["| case | size | " + " | ".join(keys) + " |", "| --- | --- |" + " --- |" * len(keys)]
    for r in rows:
        cells = [_value(r.get(k)) for k in keys]
        out.append(f"| {r['case']} | {human(r['size']) if 'size' in r else ''} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _value(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_value(x)}" for k, x in v.items())
    return str(v).replace("|", "\\|").replace("\n", " ")


def write_out(result: dict[str, Any], out_dir: str) -> list[str]:
    """Write results.json, results.md and the plots under `out_dir`; return the paths written.

    Without matplotlib the plots are left out, and stderr says what adds them.
    """
    os.makedirs(out_dir, exist_ok=True)
    written = [os.path.join(out_dir, "results.json"), os.path.join(out_dir, "results.md")]
    write_json(result, written[0])
    with open(written[1], "w") as f:
        f.write(markdown(result))
    try:
        from ._plots import plot_e2e

        written += plot_e2e(result["rows"], out_dir)
    except ImportError as e:
        if (e.name or "").partition(".")[0] != "matplotlib":
            raise
        print("no plots: matplotlib is not installed (`pip install rdt_async[bench]` adds plots)", file=sys.stderr)
    return written

"""python -m rdt_async.bench [--quick] [--out DIR] [--hosts 1|2|flat|split|three] [--sizes ...] [--repeat 3] [--json out.json] [--only e2e,...]

The headline is `e2e`: from the producing call until the consumer has read every byte,
every rdt path against Ray's (object store default and zero-copy, Ray's own RDT), as
ratios to the best Ray path of the same run. With `--hosts three`, `fanout` moves one
object to 8 consumers on two other hosts, and `publish` times a trainer publishing a
state dict every step to 8 subscribers there (`rdt.Publisher` against Ray's zero-copy
store and the hand-written pattern; issue 33's targets). The other benches time pieces
(a fetch of a ref in hand, a transport against its raw library).
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import shlex
import sys
import time
from typing import Any

import ray
import torch

from ._progress import Progress
from ._report import markdown, under_the_limit, write_json, write_out
from ._units import human, parse_size

# What a run takes where the command line does not say; `--quick` first fills in its own.
DEFAULTS = {"only": "", "repeat": 3, "e2e_sizes": "4K,1M,64M,256M", "e2e_fanouts": "4,8", "e2e_paths": ""}
QUICK = {"only": "e2e", "repeat": 3, "e2e_sizes": "4K,1M,64M", "e2e_fanouts": "4",
         "e2e_paths": "rdt auto,rdt nixl,ray object store,ray object store zero-copy,ray rdt nixl,physical limit"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; `--quick` fills in only what it does not give (QUICK), then DEFAULTS the rest."""
    ap = argparse.ArgumentParser(prog="python -m rdt_async.bench", description=__doc__)
    ap.add_argument("--sizes", default="4K,1M,64M,256M,512M")
    ap.add_argument("--repeat", type=int, default=None, help=f"warm rounds (default {DEFAULTS['repeat']})")
    ap.add_argument("--json", default="",
                    help="file for the JSON results ('-': stdout, the default without --out)")
    ap.add_argument(
        "--only", default=None, help="comma-separated: e2e,fanout,publish," + ",".join(OTHERS) + " (default: all)"
    )
    ap.add_argument("--e2e-sizes", default=None, help=f"sizes of the end-to-end passes (default {DEFAULTS['e2e_sizes']})")
    ap.add_argument("--e2e-paths", default=None, help="comma-separated, e.g. 'rdt auto,ray object store zero-copy'")
    ap.add_argument("--e2e-shapes", default="",
                    help="comma-separated producer shapes: kept (share_memory_() once), plain (kept, never "
                         "shared), fresh (a new tensor each call); default: all")
    ap.add_argument("--e2e-fanouts", default=None,
                    help=f"consumers of one object in the fan-out passes ('': none; default {DEFAULTS['e2e_fanouts']})")
    ap.add_argument("--hosts", choices=HOSTS, default="1",
                    help="1: one host; flat or split (2 is flat): e2e consumers on a second host, joined by a "
                         "veth link that is its default route (flat) or on a data network that is nobody's "
                         "(split); three: split with a third host, for the fan-out and the publishing across "
                         "hosts (network namespaces: needs root)")
    ap.add_argument("--fanout-sizes", default="256M,512M,1G",
                    help="sizes of the fan-out across hosts (--hosts three): 1 producer, 8 consumers on 2 hosts")
    ap.add_argument("--publish-sizes", default="1G",
                    help="state-dict sizes of the versioned publishing across hosts (--hosts three): a trainer "
                         "publishes ~200 tensors every step to 8 subscribers on 2 hosts")
    ap.add_argument("--publish-pause", type=float, default=None, metavar="S",
                    help="seconds between the versions the trainer publishes (its training step; default longer "
                         "than the actors keep idle warm memory, as a step of tens of seconds is; 0: back to back)")
    ap.add_argument("--write-costs", default="", metavar="FILE",
                    help="fit auto's cost model to the e2e passes of the plain shape (a kept tensor never shared, "
                         "as most users return) and merge it into FILE (for RDT_AUTO_COSTS)")
    ap.add_argument("--quick", action="store_true",
                    help="the end-to-end headline only, fewer sizes and paths: a few minutes on 2 cores (--only "
                         f"{QUICK['only']} --repeat {QUICK['repeat']} --e2e-sizes {QUICK['e2e_sizes']} --e2e-fanouts "
                         f"{QUICK['e2e_fanouts']} and a subset of the paths, each where the command line gives none)")
    ap.add_argument("--out", default="", metavar="DIR",
                    help="write DIR/results.json, DIR/results.md and plots of the end-to-end passes (PNG)")
    ap.add_argument("--no-progress", action="store_true",
                    help="no progress bar (there is none anyway where stderr is not a terminal)")
    args = ap.parse_args(argv)
    for key, value in [*(QUICK.items() if args.quick else ()), *DEFAULTS.items()]:
        if getattr(args, key) is None:  # not on the command line (an explicit '' stays: none)
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    only = set(filter(None, args.only.split(",")))

    def want(name: str) -> bool:
        return not only or name in only

    from ._e2e import COSTS_SHAPE, check_costs_file, check_costs_shapes, check_paths, check_shapes

    paths = check_paths(args.e2e_paths)  # a wrong name says so now, not as a failed row after minutes
    shapes = check_shapes(args.e2e_shapes)
    if args.write_costs:
        check_costs_file(args.write_costs)  # now, not after the run
        check_costs_shapes(shapes)
    from ..transports import _auto

    try:
        _auto.cost_table(False)  # a bad RDT_AUTO_COSTS says so now, not in every auto pass
    except ValueError as e:
        raise SystemExit(str(e)) from e
    from ._hosts import ray_cluster

    rows: list[dict[str, Any]] = []
    others = [b for b in OTHERS if want(b)]
    hosts, topology = HOSTS[args.hosts]
    with ray_cluster(hosts, topology=topology), Progress(False if args.no_progress else None) as progress:
        progress.add(len(others))
        if want("e2e"):
            from . import _e2e

            e2e_sizes = [parse_size(s) for s in args.e2e_sizes.split(",")]
            rows += _e2e.run(e2e_sizes, args.repeat, progress=progress, paths=paths, hosts=min(hosts, 2),
                             shapes=shapes, fanouts=tuple(int(k) for k in args.e2e_fanouts.split(",") if k.strip()))
            if args.write_costs:
                fitted = _e2e.write_costs(rows, args.write_costs)
                progress.note(f"auto's costs ({len(fitted)} paths, fitted to the {COSTS_SHAPE} shape's passes) "
                              f"merged into {args.write_costs}")
        if want("fanout") and (hosts == 3 or "fanout" in only):
            from . import _fanout

            rows += _fanout.run([parse_size(s) for s in args.fanout_sizes.split(",")], args.repeat, hosts, progress)
        if want("publish") and (hosts == 3 or "publish" in only):
            from . import _publish

            pause = _publish.PAUSE_S if args.publish_pause is None else args.publish_pause
            rows += _publish.run([parse_size(s) for s in args.publish_sizes.split(",")], args.repeat, hosts, progress, pause)
        for bench in others:
            with progress.step(bench):
                rows += _other(bench, sizes, args.repeat)

    result = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": "python -m rdt_async.bench " + shlex.join(sys.argv[1:] if argv is None else argv),
        "topology": topology,
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__},
        "rows": rows,
        "checks": checks(rows),
    }
    out = sys.stdout
    if args.json or not args.out:
        out = write_json(result, args.json or "-")
    if args.out:
        for path in write_out(result, args.out):
            print(f"wrote {path}", file=sys.stderr)
    print(markdown(result), file=out)
    return 0


# --hosts: (hosts, how they are joined: rdt_async.bench._hosts.TOPOLOGIES)
HOSTS = {"1": (1, "flat"), "2": (2, "flat"), "flat": (2, "flat"), "split": (2, "split"), "three": (3, "split")}
OTHERS = ("memcpy", "fetch", "pass", "metrics", "responsiveness", "gloo", "collectives", "nixl", "ucxx")


def _other(bench: str, sizes: list[int], repeat: int) -> list[dict[str, Any]]:
    """The rows of one of the benches besides e2e (where its library is not installed, one
    row that says so)."""
    from . import _core

    if bench == "memcpy":
        return [{"bench": "memcpy", "case": "torch copy_, 1 thread, warm", "size": size,
                 "gib_s": _core.memcpy_gib_s(size, repeat)} for size in sizes if size >= 1 << 20]
    if bench == "fetch":
        return _core.fetch_rows(sizes, repeat)
    if bench == "pass":
        return _core.pass_rows(4 << 10, repeat)
    if bench == "metrics":
        return _core.metrics_rows(repeat)
    if bench == "responsiveness":
        return _core.responsiveness_rows(max(sizes))
    if bench == "gloo":
        from . import _gloo

        return _gloo.run(sizes, repeat)
    if bench == "collectives":
        from . import _collectives

        return _collectives.run(sizes, repeat)
    if bench in ("nixl", "ucxx") and importlib.util.find_spec(bench) is None:
        return [{"bench": bench, "case": "every case",
                 "skipped": f"{bench} is not installed (`pip install 'rdt_async[{bench}]'` adds it)"}]
    if bench == "nixl":
        from . import _nixl

        return _nixl.run(sizes, repeat)
    if bench == "ucxx":
        from . import _ucxx

        return _ucxx.run(sizes, repeat)
    raise ValueError(f"unknown bench {bench!r}")


def auto_could_take(size: int, hosts: int) -> tuple[set[str], str]:
    """The e2e paths `auto` could take for a CPU object of `size` bytes whose consumer is
    on the producer's host (`hosts` 1) or another (2): the transports its producer would
    prepare the object for (`transports._auto.plan` over the transports this process
    knows and can export with, at the costs in effect: RDT_AUTO_COSTS's or the declared
    ones) that reach the consumer, as "rdt <name>"; and the path every object has besides
    (the fallback)."""
    from .. import _produce
    from ..transports import _auto, _registry

    planned = _auto.plan(_registry.known_classes(), ("cpu",), size, hosts > 1, _produce.exports_here)
    reach = [c for c in planned if hosts == 1 or c.reach == "cluster"]
    return {f"rdt {c.name}" for c in reach if c.name != _registry.FALLBACK}, f"rdt {_registry.FALLBACK}"


def checks(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, as ratios against baselines measured in this run.

    Every ratio is a time ratio, ours over theirs (`X_vs_Y`: X's time over Y's): below 1,
    rdt_async is faster; a row's `vs_*` fields read the same way.
    """
    out: dict[str, Any] = {}
    rows = [r for r in rows if "error" not in r and "skipped" not in r]
    by = {(r["bench"], r["case"], r["size"]): r for r in rows}
    size = 256 << 20
    into, memcpy = by.get(("fetch", "rdt auto, into=", size)), by.get(("memcpy", "torch copy_, 1 thread, warm", size))
    if into and memcpy:  # the fetch into= (until it returned) against one warm copy of its bytes
        out["into_256M_fetch_vs_memcpy"] = round(into["fetch_s"] / (size / memcpy["gib_s"] / 2**30), 3)
    slower = []
    for (bench, case, s), r in by.items():
        if bench == "fetch" and case == "rdt auto (shm)":
            ray_row = by.get(("fetch", "ray object store", s))
            if ray_row and r["fetch_read_s"] > ray_row["fetch_read_s"]:
                slower.append(s)
    if any(r["bench"] == "fetch" for r in rows):
        out["sizes_where_auto_slower_than_ray_object_store"] = slower
    p_ours, p_ray = by.get(("pass", "rdt auto", 4096)), by.get(("pass", "ray object store", 4096))
    if p_ours and p_ray:
        out["pass_4K_vs_object_store"] = round(p_ours["seconds"] / p_ray["seconds"], 3)
    m_on, m_off = by.get(("metrics", "rdt auto, metrics on", 4096)), by.get(("metrics", "rdt auto, RDT_METRICS=0", 4096))
    if m_on and m_off:
        out["pass_4K_metrics_on_vs_off"] = round(m_on["seconds"] / m_off["seconds"], 3)
    for r in rows:
        if r["bench"] == "e2e" and r["case"] == "rdt auto" and "vs_best_ray" in r:
            key = f"e2e_auto_{r['shape']}_{human(r['size']).replace(' ', '')}_x{r['consumers']}"
            key += "_hosts2" if r.get("hosts", 1) == 2 else ""
            out[f"{key}_vs_best_ray"] = round(r["vs_best_ray"], 3)
            # what auto could take here: what its producer prepares (no group, no ucxx: auto
            # never prepares it; no nixl for CPU objects at the declared costs), or the fallback
            planned, fallback = auto_could_take(r["size"], r.get("hosts", 1))
            ours = {o["case"]: o["seconds"] for o in rows if o["bench"] == "e2e" and o["case"] in {*planned, fallback}
                    and (o["shape"], o["size"], o["consumers"], o.get("hosts", 1))
                    == (r["shape"], r["size"], r["consumers"], r.get("hosts", 1))}
            if planned & ours.keys():  # (a path auto takes ran named: not inline's, at 4 KiB)
                out[f"{key}_vs_fastest_auto_could_take"] = round(r["seconds"] / min(ours.values()), 3)
            if "vs_limit" in r:
                out[f"{key}_vs_physical_limit"] = round(r["vs_limit"], 3)
    under = under_the_limit(rows)
    if under:  # (suspect: see under_the_limit)
        out["e2e_under_physical_limit"] = under
    for r in rows:
        if r["bench"] == "fanout" and "vs_ray_zero_copy" in r and r["case"] != "ray object store zero-copy":
            key = f"fanout_{r['case'].replace('rdt ', '').replace(', into=', '_into')}_{human(r['size']).replace(' ', '')}"
            out[f"{key}_x{r['consumers']}_hosts3_vs_ray_zero_copy"] = r["vs_ray_zero_copy"]
            out[f"{key}_worst_ping_ms"] = r["loop_stall_ms"]
            if "loop_held_ms" in r:
                out[f"{key}_loop_held_ms"] = r["loop_held_ms"]
    for r in rows:
        if r["bench"] == "publish" and r["case"] in ("rdt publish", "rdt publish, stream") and "seconds" in r:
            key = f"publish{'_stream' if r['case'].endswith('stream') else ''}_{human(r['size']).replace(' ', '')}"
            key += f"_x{r['subscribers']}_hosts3"
            for target in ("vs_ray_zero_copy", "vs_hand_written"):
                if target in r:
                    out[f"{key}_{target}"] = r[target]
            out[f"{key}_worst_ping_ms"] = r["loop_stall_ms"]
            if "loop_held_ms" in r:
                out[f"{key}_loop_held_ms"] = r["loop_held_ms"]
            out[f"{key}_trainer_stall_vs_one_copy"] = r["trainer_stall_vs_one_copy"]
    resp = [r for r in rows if r["bench"] == "responsiveness"]
    if resp:
        out["worst_ping_ms_while_arriving"] = round(max(r["worst_ping_ms"] for r in resp), 1)
    return out


if __name__ == "__main__":
    raise SystemExit(main())

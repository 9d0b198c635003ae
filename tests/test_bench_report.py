"""The bench's report: results.json, results.md and the plots from e2e rows, and its loop-stall probe.

No Ray cluster: the rows are copied from a `python -m rdt_async.bench --quick` run.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import os
import struct
import subprocess
import sys
import time

import pytest

from rdt_async.bench._loop import LoopStall
from rdt_async.bench._progress import Progress
from rdt_async.bench._report import markdown, write_out

MIB = 1 << 20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# One plot per figure: each measure for each panel (a shape with one consumer, fan-out).
PLOTS = tuple(f"{m}-{p}.png" for m in ("e2e_throughput", "e2e_latency", "loop_stall") for p in ("kept", "fresh", "fanout"))


def _row(case: str, shape: str, size: int, seconds: float, stall: float | None, consumers: int = 1) -> dict:
    """An e2e row as the bench writes it (this one from its --quick run, values changed)."""
    row = {"bench": "e2e", "case": "rdt auto", "shape": "kept", "size": 67108864, "consumers": 1, "hosts": 1,
           "cold_s": 0.08787276200018823, "seconds": 0.01458551600080682, "loop_stall_ms": 0.533,
           "breakdown": {"calls_s": 0.007937865004350897, "fetch_s": 0.0012847419966419693,
                         "read_s": 0.006779413000913337},
           "vs_best_ray": 0.19616996173618356}
    row.update(case=case, shape=shape, size=size, seconds=seconds, loop_stall_ms=stall, consumers=consumers)
    if consumers > 1:  # fan-out rows have no cold pass and no breakdown
        del row["cold_s"], row["breakdown"]
    return row


def _result() -> dict:
    rows = []
    for case, scale, stall in (("rdt auto", 1.0, 0.5), ("ray object store", 3.0, 85.5), ("ray rdt nixl", 2.0, None)):
        for shape in ("kept", "fresh"):
            for size in (4 << 10, MIB, 64 * MIB):
                rows.append(_row(case, shape, size, scale * (0.003 + size / 5e9), stall))
        rows.append(_row(case, "kept", 64 * MIB, scale * 0.036, stall, consumers=4))
    best = {}
    for r in rows:
        if r["case"].startswith("ray "):
            key = (r["shape"], r["size"], r["consumers"])
            best[key] = min(best.get(key, 1e9), r["seconds"])
    for r in rows:
        r["vs_best_ray"] = r["seconds"] / best[(r["shape"], r["size"], r["consumers"])]
    rows.append({"bench": "e2e", "case": "ray rdt gloo", "hosts": 1, "error": "RuntimeError: no group\nmore"})
    rows.append({"bench": "pass", "case": "rdt auto", "size": 4096, "seconds": 0.002442})
    return {"when": "2026-11-23T13:47:02", "command": "python -m rdt_async.bench --quick",
            "machine": {"python": "3.11.7", "torch": "2.13.0+cpu", "ray": "2.60.0"},
            "rows": rows, "checks": {"e2e_auto_kept_64MiB_x1_vs_best_ray": 0.333}}


def _png_size(path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk, after checking its signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_markdown_holds_the_e2e_tables_the_other_rows_and_the_checks():
    md = markdown(_result())
    lines = md.splitlines()
    # One table per shape (no page cuts the last column of 8): kept with its fan-out, then fresh.
    assert [line for line in lines if line.startswith("| path |")] == [
        "| path | kept 4 KiB | kept 1 MiB | kept 64 MiB | kept 64 MiB to 4 |", "| path | fresh 4 KiB | fresh 1 MiB | fresh 64 MiB |"] * 2
    auto = next(line for line in lines if line.startswith("| rdt auto | ") and " ms" in line)
    cells = [c.strip() for c in auto.strip("|").split("|")]
    assert cells[3] == "16.4 ms (0.50x), cold 87.9"  # kept 64 MiB: 3 ms + 64 MiB / 5 GB/s, Ray twice that
    assert cells[4] == "36 ms (0.50x)"  # fan-out: no cold pass
    stalls = [line for line in lines if line.startswith("| ray object store | ") and " ms" not in line]
    assert stalls == ["| ray object store | 85.5 | 85.5 | 85.5 | 85.5 |", "| ray object store | 85.5 | 85.5 | 85.5 |"]
    assert "| ray rdt nixl | — | — | — | — |" in lines and "| ray rdt nixl | — | — | — |" in lines  # a sync consumer: no loop
    assert lines.count("| ray rdt gloo | failed: RuntimeError: no group |") == 2  # under the first table of each
    assert "## pass" in lines and "| rdt auto | 4 KiB | 0.002442 |" in lines
    assert "| e2e_auto_kept_64MiB_x1_vs_best_ray | 0.333 |" in lines


def test_out_dir_holds_json_markdown_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    result = _result()
    written = write_out(copy.deepcopy(result), str(tmp_path / "out"))
    out = tmp_path / "out"
    assert sorted(written) == sorted(str(out / n) for n in ("results.json", "results.md", *PLOTS))
    assert json.loads((out / "results.json").read_text()) == result
    assert (out / "results.md").read_text() == markdown(result)
    for name in PLOTS:
        width, height = _png_size(out / name)
        assert width >= 800 and height >= 500, name  # one plot per figure, at a docs page's width
        try:
            from PIL import Image
        except ImportError:
            from matplotlib.image import imread

            assert imread(out / name).shape[:2] == (height, width)
        else:
            with Image.open(out / name) as image:
                image.verify()
                assert image.size == (width, height)


def test_out_dir_without_matplotlib_writes_the_rest_and_says_what_adds_plots(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    written = write_out(_result(), str(tmp_path))
    assert sorted(written) == sorted(str(tmp_path / n) for n in ("results.json", "results.md"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "results.md"]
    assert "pip install rdt_async[bench]" in capsys.readouterr().err


async def test_loop_stall_reports_a_blocked_loop():
    stall = LoopStall()
    await asyncio.sleep(0.01)
    time.sleep(0.05)  # what a blocking fetch does to the loop
    await asyncio.sleep(0.01)
    assert stall.stop() >= 0.04


async def test_loop_stall_counts_a_stall_still_under_way():
    stall = LoopStall()
    await asyncio.sleep(0.01)
    time.sleep(0.05)  # the probe has not run since: `stop` sees the stall all the same
    assert stall.stop() >= 0.04


@pytest.mark.allow_stall  # it blocks its loop on purpose
async def test_loop_stall_holds_a_blocking_call_against_the_loop_but_not_a_wait_for_a_core():
    """`held` counts what the loop's thread did (a blocking call: held) and leaves out what
    the machine did to it (no core free): `worst` counts both, as a caller feels them."""
    stall = LoopStall()
    await asyncio.sleep(0.01)
    time.sleep(0.06)  # held: the thread blocks, runnable time it does not wait
    await asyncio.sleep(0.01)
    stall.stop()
    assert stall.worst >= 0.05 and stall.held >= 0.05
    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("no per-thread schedstat here: held equals worst")
    affinity = os.sched_getaffinity(0)
    core = min(affinity)
    hog = subprocess.Popen(
        [sys.executable, "-c", f"import os, sys, time\nos.sched_setaffinity(0, {{{core}}})\nprint(flush=True)\n"
         "end = time.monotonic() + 3\nwhile time.monotonic() < end: pass"],
        stdout=subprocess.PIPE,
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline() == b"\n"  # spinning on `core` from now
        os.sched_setaffinity(0, {core})  # this thread shares the hog's one core
        stall = LoopStall()
        await asyncio.sleep(0.01)
        # A blocking call that needs 0.1 s of a core, on a core shared with a spinning
        # process: the scheduler gives each about half (neither sleeps, so neither is
        # favoured on waking), so it holds the loop ~0.2 s, ~0.1 s of it waiting for the core.
        ran_until = time.thread_time() + 0.1
        while time.thread_time() < ran_until:
            pass
        await asyncio.sleep(0.01)
        stall.stop()
    finally:
        os.sched_setaffinity(0, affinity)
        hog.kill()
        hog.wait()
    # `worst` counts the wait for the core, which `held` leaves out.
    assert stall.held >= 0.09, (stall.worst, stall.held)
    assert stall.worst > stall.held + 0.03, (stall.worst, stall.held)


async def test_loop_stall_is_near_zero_on_a_free_loop():
    stall = LoopStall()
    for _ in range(20):
        await asyncio.sleep(0.005)
    assert stall.stop() < 0.025  # timer slack and a busy 2-core machine, not a stall


def test_progress_is_silent_off_a_terminal_but_notes_show(capsys):
    with Progress() as progress:  # stderr is captured here: not a terminal
        progress.add(2)
        with progress.step("e2e rdt auto kept 4 KiB"):
            pass
        progress.skip(1)
        progress.note("e2e ray rdt gloo: failed to set up")
    assert capsys.readouterr().err == "e2e ray rdt gloo: failed to set up\n"


def test_progress_bar_shows_the_step_under_way(capsys):
    pytest.importorskip("tqdm")
    with Progress(True) as progress:
        progress.add(3)
        with progress.step("e2e rdt auto kept 4 KiB"):
            pass
        progress.add(1)
        progress.skip(3)
    err = capsys.readouterr().err
    assert "e2e rdt auto kept 4 KiB" in err and "4/4" in err


def test_rows_are_compared_with_the_best_ray_path_and_the_physical_limit_of_their_column():
    from rdt_async.bench.__main__ import checks
    from rdt_async.bench._e2e import LIMIT, _ratios, check_paths

    rows = [_row("rdt auto", "kept", 64 * MIB, 0.012, 0.5), _row("ray object store", "kept", 64 * MIB, 0.240, 9.0),
            _row("ray object store zero-copy", "kept", 64 * MIB, 0.020, 9.0), _row(LIMIT, "kept", 64 * MIB, 0.008, 0.2),
            _row("rdt auto", "kept", 64 * MIB, 0.090, 2.0, consumers=8),
            _row("ray object store zero-copy", "kept", 64 * MIB, 0.100, 9.0, consumers=8)]
    for r in rows:
        r.pop("vs_best_ray")
    _ratios(rows)
    auto, _, zero_copy, limit, fanned, _ = rows
    assert auto["vs_best_ray"] == pytest.approx(0.6) and auto["vs_limit"] == pytest.approx(1.5)
    assert zero_copy["vs_limit"] == pytest.approx(2.5) and "vs_limit" not in limit
    assert limit["vs_best_ray"] == pytest.approx(0.4)  # the floor any path could reach, against Ray
    assert "vs_limit" not in fanned  # no limit measured for that column
    got = checks(rows)
    assert got["e2e_auto_kept_64MiB_x1_vs_physical_limit"] == 1.5
    assert "e2e_auto_kept_64MiB_x8_vs_physical_limit" not in got
    assert check_paths(" Physical  Limit,rdt auto") == [LIMIT, "rdt auto"]


def test_paths_that_did_not_run_are_rows_that_say_why():
    rows = [{"bench": "e2e", "case": "rdt nixl", "hosts": 1, "skipped": "nixl is not installed (`pip install 'rdt_async[nixl]'` adds it)"},
            {"bench": "ucxx", "case": "every case", "skipped": "ucxx is not installed"}]
    md = markdown({"rows": rows})
    assert "| rdt nixl | not run: nixl is not installed (`pip install 'rdt_async[nixl]'` adds it) |" in md.splitlines()
    assert "| every case |  | ucxx is not installed |" in md.splitlines()
    from rdt_async.bench.__main__ import checks

    assert checks(rows) == {}  # (a row with no size once failed here)


def test_the_physical_limit_is_drawn_unlike_every_path(tmp_path):
    pytest.importorskip("matplotlib")
    from rdt_async.bench._plots import LIMIT, _style, panels, plot_e2e

    limit, ray_path, ours = _style(LIMIT, "C3"), _style("ray object store", "C3"), _style("rdt auto", "C0")
    assert (limit["color"], limit["linestyle"]) == ("black", ":")
    assert {ray_path["linestyle"], ours["linestyle"]} == {"--", "-"} and ray_path["color"] != "black"
    rows = _result()["rows"] + [_row(LIMIT, shape, size, 0.002, 0.1) for shape in ("kept", "fresh") for size in (4 << 10, MIB)]
    assert [p[0] for p in panels([r for r in rows if r["bench"] == "e2e" and "seconds" in r])] == ["kept", "fresh", "fanout"]
    assert len(plot_e2e(rows, str(tmp_path))) == 9


def _publish_row(case: str, seconds: float, stall_ms: float, trainer_stall_s: float) -> dict:
    """A publish row as the bench writes it (this one from its 64 MiB run, values changed)."""
    row = {"bench": "publish", "case": case, "size": 64 * MIB, "subscribers": 8, "hosts": 3, "cold_s": 1.591,
           "seconds": seconds, "trainer_stall_s": trainer_stall_s, "loop_stall_ms": stall_ms,
           "one_copy_s": 0.02, "state_bytes": 67108800}
    row["trainer_stall_vs_one_copy"] = round(trainer_stall_s / row["one_copy_s"], 3)
    if case.startswith("rdt publish"):
        row.update(link_transfers=2, relayed=6, publisher_slots=2, publisher_bytes=134220800, memory_vs_state=2.0)
    return row


def test_publish_rows_give_issue_33s_checks_against_ray_and_the_hand_written_pattern():
    from rdt_async.bench.__main__ import checks
    from rdt_async.bench._fanout import vs_ray_zero_copy
    from rdt_async.bench._publish import _with_ratios

    rows = [_publish_row("rdt publish", 0.3, 12.5, 0.02), _publish_row("rdt publish, stream", 0.4, 30.0, 0.025),
            _publish_row("ray object store zero-copy", 0.8, 250.0, 0.045), _publish_row("hand-written", 0.6, 200.0, 0.005)]
    _with_ratios(rows)
    assert [r["vs_ray_zero_copy"] for r in rows] == [0.375, 0.5, 1.0, 0.75]
    assert [r["vs_hand_written"] for r in rows] == [0.5, 0.667, 1.333, 1.0]
    got = checks(rows)
    assert {k: v for k, v in got.items() if k.startswith("publish_64MiB")} == {
        "publish_64MiB_x8_hosts3_vs_ray_zero_copy": 0.375, "publish_64MiB_x8_hosts3_vs_hand_written": 0.5,
        "publish_64MiB_x8_hosts3_worst_ping_ms": 12.5, "publish_64MiB_x8_hosts3_trainer_stall_vs_one_copy": 1.0}
    assert got["publish_stream_64MiB_x8_hosts3_vs_ray_zero_copy"] == 0.5
    # A path that failed (a wrong version) is a row that says so: no check, no ratio.
    failed = [{"bench": "publish", "case": "rdt publish", "size": 64 * MIB, "subscribers": 8, "hosts": 3,
               "error": "AssertionError: rdt publish, version 3: layer0.weight holds [2.0], not 3 throughout"},
              rows[2]]
    vs_ray_zero_copy(failed)
    assert "vs_ray_zero_copy" not in failed[0] and checks(failed) == {}
    line = next(line for line in markdown({"rows": failed}).splitlines() if line.startswith("| rdt publish |"))
    assert line.startswith("| rdt publish | 64 MiB | 8 | 3 | AssertionError: rdt publish, version 3: layer0.weight holds")


def test_a_subscriber_s_check_finds_a_wrong_version_a_mix_and_a_torn_tensor():
    import torch

    from rdt_async.bench._publish import _state, _wrong

    model = {k: t.fill_(3.0) for k, t in _state(4 * MIB).items()}
    assert len(model) == 200 and 4 * MIB - 4096 < sum(t.nbytes for t in model.values()) <= 4 * MIB
    assert _wrong(model, model, 3.0) is None
    assert _wrong(model, model, 2.0) == "layer0.weight holds [3.0], not 2 throughout"
    model["layer7.norm"].fill_(2.0)  # a mix of two versions
    assert _wrong(model, model, 3.0) == "layer7.norm holds [2.0], not 3 throughout"
    model["layer7.norm"].fill_(3.0)
    model["layer9.weight"][-5000:] = 2.0  # torn: the tail of a tensor from the version before
    assert _wrong(model, model, 3.0).startswith("layer9.weight holds [2.0, 3.0]")
    assert _wrong(model, {**model, "layer1.norm": torch.zeros(1024)}, 3.0) == "layer1.norm did not land in the model's tensor"


def test_a_publish_path_that_broke_keeps_the_passes_it_finished_but_a_wrong_version_is_an_error():
    from rdt_async.bench._publish import _row

    step = {"seconds": 0.5, "trainer_stall_s": 0.02, "one_copy_s": 0.025, "stall_s": 0.004, "held_s": 0.002, "link": 2,
            "relayed": 6, "breakdown": {"first_loaded_s": 0.3, "all_loaded_s": 0.45}}
    setup, memory = {"one_copy_s": 0.02, "state_bytes": 64 * MIB}, {"slots": 2, "slot_bytes": 64 * MIB}
    cold_and_warm = [[step] * 4, [step] * 4]
    broke = "round 2: OutOfMemoryError: 1 worker(s) were killed"
    row = _row("rdt publish", cold_and_warm, None, broke, setup, memory, 64 * MIB, 8)
    assert row["seconds"] == 0.5 and row["broke"] == broke and "error" not in row
    assert (row["loop_stall_ms"], row["loop_held_ms"]) == (4.0, 2.0)
    assert row["breakdown"] == {"first_loaded_s": 0.3, "all_loaded_s": 0.45} and row["memory_vs_state"] == 2.0
    # The stall against the copy timed in the same steps; the one at setup is shown beside.
    assert (row["trainer_stall_vs_one_copy"], row["one_copy_s"], row["quiet_copy_s"]) == (0.8, 0.025, 0.02)
    assert _row("rdt publish", cold_and_warm[:1], None, broke, setup, memory, 64 * MIB, 8)["error"] == broke
    wrong = "AssertionError: rdt publish, version 7: layer3.weight holds [6.0], not 7 throughout"
    assert "seconds" not in _row("rdt publish", cold_and_warm, wrong, None, setup, memory, 64 * MIB, 8)


def test_a_publish_size_this_machine_cannot_hold_is_refused_with_the_size_that_fits():
    """Every host of `--hosts three` is on this machine: 1 GiB to 8 subscribers took 22 GB
    before Ray's OOM killer ended the run. Refused at once, naming a size to pass instead."""
    from rdt_async.bench._publish import too_big

    why = too_big(1 << 30, 8, available=24 << 30)
    assert why is not None and why.startswith("publishing 1 GiB to 8 subscribers needs about 23 GiB of memory")
    fits = int(why.split("--publish-sizes ")[1].split("M")[0])
    assert 512 < fits < 1024 and too_big(fits << 20, 8, available=24 << 30) is None
    assert too_big(256 << 20, 8, available=24 << 30) is None
    assert too_big(1 << 30, 8, available=64 << 30) is None


E2E_PATHS = ("rdt auto", "rdt auto into=", "rdt shm", "rdt tcp", "rdt nixl", "rdt ucxx", "rdt object_store", "rdt gloo",
             "ray object store", "ray object store zero-copy", "ray rdt gloo", "physical limit")


@pytest.mark.parametrize("n", [2, 3, 4, 5, 11, 12])
def test_paths_take_turns_in_a_balanced_order(n):
    """Over a cycle of rounds each path runs first equally often and right after every
    other path equally often: no path always inherits the same one's leftovers (before,
    a rotation put `rdt auto` right after `physical limit`, and Ray's zero-copy store
    right after Ray's plain store, in every round)."""
    from collections import Counter

    from rdt_async.bench._turns import in_turns, williams

    paths = E2E_PATHS[:n]
    cycle = len(williams(n))
    assert cycle == (n if n % 2 == 0 else 2 * n)
    rounds = [in_turns(paths, r) for r in range(cycle)]
    assert all(sorted(r) == sorted(paths) for r in rounds)
    after = Counter(pair for r in rounds for pair in itertools.pairwise(r))
    assert len(after) == n * (n - 1) and len(set(after.values())) == 1, after
    assert len(set(Counter(r[0] for r in rounds).values())) == 1
    assert in_turns(paths, cycle + 1) == rounds[1]  # the cycle repeats


def test_a_path_that_breaks_keeps_its_passes_and_leaves_the_later_rounds():
    """One pass that raises ends its path, not the run: the passes before stand, the
    others go on, and each pass (the failed one too) is followed by a settle."""
    from rdt_async.bench._turns import take_turns

    calls: list[tuple[str, int]] = []
    paused: list[float] = []
    ended: list[str] = []

    def pass_of(name: str):
        def one() -> tuple[float, None]:
            calls.append((name, len([c for c in calls if c[0] == name])))
            if name == "b" and len([c for c in calls if c[0] == "b"]) == 3:  # its third pass: round 2
                raise RuntimeError("actor died")
            return float(len(calls)), None
        return one

    turns = take_turns({n: pass_of(n) for n in "abc"}, 4, pause=paused.append, broke=ended.append)
    assert ended == ["b"] and turns.why("b") == "round 2: RuntimeError: actor died" and turns.why("a") is None
    assert len(turns.warm["a"]) == len(turns.warm["c"]) == 4 and len(turns.warm["b"]) == 1  # round 1 only
    assert set(turns.cold) == {"a", "b", "c"}
    assert [len(t) for t in (turns.turns["a"], turns.turns["b"], turns.turns["c"])] == [5, 2, 5]
    assert len(paused) == len(calls) == 5 + 3 + 5  # the failed pass is followed by its settle too
    assert sorted(turns.turns["a"][:2] + turns.turns["b"] + turns.turns["c"][:2]) == [0, 0, 1, 1, 2, 2]


def test_a_path_whose_actors_fail_to_close_too_still_leaves_the_run_going():
    """Closing a broken path's actors (a collective group's destroy) may raise as well: the
    run, and every path's passes, were lost with it."""
    from rdt_async.bench._turns import take_turns

    def closing(name: str) -> None:
        raise RuntimeError("destroy_collective_group: actor died")

    def ok() -> float:
        return 1.0

    def dies() -> float:
        raise RuntimeError("actor died")

    turns = take_turns({"a": ok, "b": dies}, 2, pause=lambda s: None, broke=closing)
    assert len(turns.warm["a"]) == 2 and turns.warm["b"] == []
    assert turns.why("b") == "round 0: RuntimeError: actor died"
    assert "closing its actors then failed too: RuntimeError: destroy_collective_group" in turns.broke["b"][1].__notes__[0]


def test_e2e_rows_of_a_path_that_broke_say_so_with_the_passes_it_finished():
    from rdt_async.bench._e2e import turn_rows
    from rdt_async.bench._turns import Turns

    turns = Turns(cold={"rdt auto": (0.5, 1.0), "rdt tcp": (0.4, 1.0)},
                  warm={"rdt auto": [(0.1, 2.0), (0.3, 4.0), (0.2, 3.0)], "rdt tcp": [(0.25, 1.0)], "rdt nixl": []},
                  turns={"rdt auto": [0, 1, 2, 0], "rdt tcp": [1, 0], "rdt nixl": []},
                  broke={"rdt tcp": (2, RuntimeError("killed")), "rdt nixl": (0, ValueError("no agent"))})
    auto, tcp, nixl = turn_rows(turns, ["rdt auto", "rdt tcp", "rdt nixl"], {"shape": "plain", "size": MIB, "consumers": 1, "hosts": 1})
    assert auto == {"bench": "e2e", "case": "rdt auto", "shape": "plain", "size": MIB, "consumers": 1, "hosts": 1,
                    "cold_s": 0.5, "seconds": 0.2, "loop_stall_ms": 4000.0, "passes": 3, "passes_s": [0.1, 0.3, 0.2],
                    "turns": [0, 1, 2, 0]}
    assert tcp["seconds"] == 0.25 and tcp["broke"] == "round 2: RuntimeError: killed" and tcp["passes"] == 1
    assert "seconds" not in nixl and nixl["error"] == "round 0: ValueError: no agent" and nixl["shape"] == "plain"
    rows = [_row("rdt auto", "kept", MIB, 0.01, 0.5), _row("rdt auto", "plain", MIB, 0.02, 0.5), tcp, nixl]
    lines = markdown({"rows": rows}).splitlines()
    kept, plain = (lines.index(h) for h in ("| path | kept 1 MiB |", "| path | plain 1 MiB |"))
    broke = lines.index("| rdt tcp | broke at plain 1 MiB after 1 warm pass, left out from then on: round 2: RuntimeError: killed |")
    failed = lines.index("| rdt nixl | failed at plain 1 MiB: round 0: ValueError: no agent |")
    assert kept < plain < broke and plain < failed  # under the table of the shape they broke at
    assert "| rdt tcp | 250 ms, cold 400 |" in lines  # its passes stand


def test_a_killed_paths_processes_are_waited_for(monkeypatch):
    """Killing a path's actors returns once their processes have ended, not as soon as
    Ray is told: their teardown does not land in the next path's passes."""
    import threading

    import ray

    from rdt_async.bench import _turns

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    killed = []

    def kill(actor) -> None:  # as Ray does: the process ends a while after the call returns
        killed.append(actor)
        threading.Timer(0.3, proc.kill).start()

    monkeypatch.setattr(ray, "kill", kill)
    try:
        started = time.monotonic()
        _turns.end_actors(["producer"], [proc.pid], timeout=10)
        assert killed == ["producer"] and _turns.exited(proc.pid) and 0.25 < time.monotonic() - started < 5
    finally:
        proc.kill()
        proc.wait()


class _Call:
    """An actor method whose `.remote()` runs at once, here (`ray.get` of its result: itself)."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


def test_publish_releases_warm_memory_in_the_pause_and_times_the_hand_written_pattern_from_its_call(monkeypatch):
    """The hand-written pattern's warm-memory release runs in the pause, untimed (it ran
    inside the timed `take`), and its clock starts at the driver's call of the producing
    method, as the other paths' at their producing call (it started in the method's body)."""
    import ray

    from rdt_async.bench import _publish

    log: list[tuple] = []
    monkeypatch.setattr(ray, "get", lambda x, timeout=None: x)
    monkeypatch.setattr(time, "sleep", lambda s: log.append(("sleep", s)))

    def step(path, value):
        log.append(("step", path))
        refs = ["put"] if path == _publish.RAY_ZERO_COPY else []
        return (None if path == _publish.HAND_WRITTEN else time.time()), 0.001, refs, 0.01

    def weights():
        log.append(("weights",))
        late = time.perf_counter() + 0.05  # Ray's call, until the method's body runs
        while time.perf_counter() < late:
            pass
        return "ref"

    def take(path, size, value, refs):
        log.append(("take", path))
        now = time.time()
        return {"loaded": now, "done": now, "stall_s": 0.001, "held_s": 0.001, "wrong": None,
                "used": {"shm": 1}, "apply_s": 0.0 if path in _publish.PUBLISHED else None}

    trainer = type("Trainer", (), {})()
    trainer.setup = _Call(lambda size, name: {"state_bytes": size, "one_copy_s": 0.01})
    trainer.step, trainer.weights = _Call(step), _Call(weights)
    trainer.memory, trainer.close = _Call(lambda: {"slots": 2, "slot_bytes": MIB}), _Call(lambda: None)
    sub = type("Subscriber", (), {})()
    sub.prepare, sub.take = _Call(lambda size, t, name: None), _Call(take)
    sub.let_go_warm = _Call(lambda: log.append(("let go",)))

    rows = {r["case"]: r for r in _publish._size(trainer, [sub], MIB, repeat=1, pause=_publish.IDLE_S + 0.5)}
    assert all("seconds" in r for r in rows.values()), rows
    assert rows[_publish.HAND_WRITTEN]["seconds"] >= 0.05 > rows[_publish.RDT_PUBLISH]["seconds"]
    hand = [i for i, e in enumerate(log) if e == ("step", _publish.HAND_WRITTEN)]
    assert len(hand) == 2 * _publish.STEPS  # a cold pass and a warm one
    for i in hand:  # before each of its versions: the release, then the pause, then the step
        assert log[i - 2] == ("let go",) and log[i - 1][0] == "sleep", log[i - 3:i + 1]
    assert log.count(("let go",)) == len(hand)  # no other path's
    assert [r["turns"] for r in rows.values()] and all(len(r["turns"]) == 2 for r in rows.values())


def test_a_fetch_bench_read_reads_every_byte():
    """The consumer's read sums every byte (it read one byte per 4 KiB page, which a
    zero-copy path's mapped pages pay almost nothing for), and checks them."""
    import torch

    from rdt_async.bench._core import read_all

    t = torch.full((3 * 4096 + 5,), 7, dtype=torch.uint8)
    assert read_all(t, 7) == 7 * t.numel() and read_all(t[:0], 7) == 0
    t[4096 + 100] = 6  # a byte no page-stride read looks at
    with pytest.raises(AssertionError, match="read 12293 bytes, not every one 7"):
        read_all(t, 7)
    t[4096 + 100], t[-1] = 7, 8  # in the tail past the last whole 8-byte word
    with pytest.raises(AssertionError):
        read_all(t, 7)
    assert read_all(torch.full((4097,), 255, dtype=torch.uint8)[1:], 255) == 255 * 4096  # not 8-aligned


async def test_every_fetch_bench_mode_times_the_refs_resolution(monkeypatch):
    """`into=`'s buffer is had by the size before the clock starts, so its clock takes in
    the ref's resolution as the other modes' do (it awaited the ref first, untimed)."""
    import torch

    import rdt_async as rdt
    from rdt_async.bench import _core

    consumer = _core.Consumer.__ray_metadata__.modified_class.__rdt_wrapped__()  # the class itself, no actor
    n = 1 << 16

    class Ref:  # resolves as a Ray ref does: a while after it is awaited
        def __await__(self):
            yield from asyncio.sleep(0.05).__await__()
            return torch.full((n,), 7, dtype=torch.uint8)

    async def fetch(ref, *, into=None):
        value = await ref
        return value if into is None else into.copy_(value)

    monkeypatch.setattr(rdt, "fetch", fetch)
    for mode in ("rdt", "into", "ray"):
        took = await consumer.fetch([Ref()], mode, n)
        assert took["fetch"] >= 0.045 and took["fetch_read"] >= took["fetch"], (mode, took)
    assert list(consumer.buffers) == [n]  # into='s buffer, made once by the size


def test_quick_fills_in_only_what_the_command_line_does_not_give():
    """`--quick --e2e-sizes 256M --repeat 9` runs 256 MiB, 9 rounds (it ran 4K,1M,64M, 3)."""
    from rdt_async.bench.__main__ import parse_args

    mine = parse_args(["--quick", "--e2e-sizes", "256M", "--repeat", "9", "--e2e-fanouts", "8", "--e2e-paths", "rdt auto"])
    assert (mine.e2e_sizes, mine.repeat, mine.e2e_fanouts, mine.e2e_paths, mine.only) == ("256M", 9, "8", "rdt auto", "e2e")
    quick = parse_args(["--quick", "--e2e-fanouts", ""])  # '' given: no fan-out
    assert (quick.e2e_sizes, quick.repeat, quick.e2e_fanouts, quick.only) == ("4K,1M,64M", 3, "", "e2e")
    assert "physical limit" in quick.e2e_paths
    full = parse_args([])
    assert (full.e2e_sizes, full.repeat, full.e2e_fanouts, full.e2e_paths, full.only) == ("4K,1M,64M,256M", 3, "4,8", "", "")


def test_auto_is_compared_with_the_paths_it_could_take_only():
    """Auto prepares a CPU object on one node for shm (nixl only where its costs say so,
    ucxx never), across hosts for tcp; the object store is every object's fallback. A
    faster ucxx or nixl row is no path auto could have taken (it counted both)."""
    from rdt_async.bench.__main__ import auto_could_take, checks

    assert auto_could_take(64 * MIB, 1) == ({"rdt shm"}, "rdt object_store")
    assert auto_could_take(64 * MIB, 2) == ({"rdt tcp"}, "rdt object_store")
    assert auto_could_take(4096, 1)[0] == {"rdt inline"}  # the bytes ride in the ref
    rows = [_row(case, "kept", size, seconds, 0.5) for size in (4096, 64 * MIB) for case, seconds in (
        ("rdt auto", 0.010), ("rdt shm", 0.012), ("rdt nixl", 0.008), ("rdt ucxx", 0.007), ("rdt object_store", 0.05))]
    got = checks(rows)
    assert got["e2e_auto_kept_64MiB_x1_vs_fastest_auto_could_take"] == 0.833
    assert "e2e_auto_kept_4KiB_x1_vs_fastest_auto_could_take" not in got  # inline's path runs under no other name
    far = [{**r, "hosts": 2} for r in rows if r["case"] != "rdt shm"] + [
        {**_row("rdt tcp", "kept", 64 * MIB, 0.02, 0.5), "hosts": 2}]
    assert checks(far)["e2e_auto_kept_64MiB_x1_hosts2_vs_fastest_auto_could_take"] == 0.5


def test_costs_are_fitted_to_one_shape_for_every_transport(tmp_path):
    """Each transport's line comes from its plain passes alone: fitted over every shape,
    each size's point was whichever shape's pass sat in the middle, another shape's for
    one transport than for the next."""
    from rdt_async.bench._e2e import check_costs_shapes, write_costs

    rows = []
    for case, (latency, gib_s) in (("rdt shm", (0.004, 2.0)), ("rdt tcp", (0.005, 1.5))):
        for size in (4096, MIB, 64 * MIB, 256 * MIB):
            plain = latency + size / (gib_s * 2**30)
            rows += [_row(case, "plain", size, plain, 0.5), _row(case, "kept", size, plain * 2, 0.5),
                     _row(case, "fresh", size, plain * 3, 0.5), _row(case, "plain", size, plain * 9, 0.5, consumers=4)]
    fitted = write_costs(rows, str(tmp_path / "costs.json"))
    assert fitted == {"shm/node": [0.004, 2.0], "tcp/node": [0.005, 1.5]}
    assert json.loads((tmp_path / "costs.json").read_text()) == {"cpu": fitted}
    with pytest.raises(SystemExit, match="--write-costs fits auto's costs to the plain shape's passes, which "
                                         "--e2e-shapes kept,fresh leaves out: add plain to it"):
        check_costs_shapes(("kept", "fresh"))
    check_costs_shapes(("plain",))


@pytest.fixture
def one_thread():
    """torch on one thread, as in a Ray worker; set back after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_physical_limit_copies_the_fastest_way_with_a_ray_workers_threads(tmp_path, one_thread):
    """The limit's copy ran on every core (torch set to all of them in its actor) while each
    path's producer has a Ray worker's threads, and a faster copy than its `copy_` (libc's
    memmove) put `auto` under it. Its allocation keeps the worker's threads; its copy is the
    fastest of the ways it knows at each size, picked before the size's passes."""
    import torch

    from rdt_async.bench import _e2e

    limit = _e2e.LimitProducer.__ray_metadata__.modified_class(str(tmp_path / "limit"))  # the class itself, no actor
    assert torch.get_num_threads() == 1  # a Ray worker's, as every producer's
    assert "memmove, split" in limit.ways and "copy_, 1 thread" in limit.ways
    n = 1 << 16
    for name, way in _e2e.copies().items():  # each way lands every byte
        mm, dst = limit.file.mapped(n)
        dst.zero_()
        way(mm, dst, torch.full((n,), 2.0))
        assert float(dst.sum()) == 2.0 * n, name
    assert torch.get_num_threads() == 1

    def slow(mm, dst, src):
        time.sleep(0.01)
        dst.copy_(src)

    limit.ways = {"slow": slow, "fast": lambda mm, dst, src: dst.copy_(src)}
    assert limit.prepare(n, "kept") is None and limit.prepare(n, "plain") == "fast"
    used = []
    limit.ways["fast"] = lambda mm, dst, src: used.append("fast") or dst.copy_(src)
    assert limit.make(n, "fresh") == n and used == ["fast"] and float(limit.file.get(n).sum()) == n


def test_a_path_under_the_physical_limit_is_flagged():
    from rdt_async.bench.__main__ import checks
    from rdt_async.bench._e2e import LIMIT, _ratios

    rows = [_row("rdt auto", "plain", 64 * MIB, 0.0092, 0.5), _row(LIMIT, "plain", 64 * MIB, 0.010, 0.2),
            _row("ray object store zero-copy", "plain", 64 * MIB, 0.011, 0.2), _row("rdt auto", "kept", 64 * MIB, 0.02, 0.5),
            _row(LIMIT, "kept", 64 * MIB, 0.010, 0.2)]
    _ratios(rows)
    assert checks(rows)["e2e_under_physical_limit"] == {"rdt auto plain 64 MiB": 0.92}
    lines = markdown({"rows": rows}).splitlines()
    assert any(line.startswith("**Under the physical limit** (suspicious") and line.endswith("rdt auto plain 64 MiB (0.92x).")
               for line in lines), lines
    rows[0]["seconds"] = 0.011
    _ratios(rows)
    assert "e2e_under_physical_limit" not in checks(rows) and "Under the physical limit" not in markdown({"rows": rows})


def test_every_ratio_is_our_time_over_theirs():
    """One convention: below 1, rdt_async is faster. `into=` against memcpy was a bandwidth
    ratio (`into_256M_vs_memcpy`, above 1 faster), NIXL's and the GPU's checks too."""
    from rdt_async.bench import gpu
    from rdt_async.bench.__main__ import checks

    size = 256 * MIB
    rows = [{"bench": "fetch", "case": "rdt auto, into=", "size": size, "fetch_s": 0.1, "fetch_read_s": 0.15,
             "gib_s": size / 0.15 / 2**30},
            {"bench": "memcpy", "case": "torch copy_, 1 thread, warm", "size": size, "gib_s": 5.0}]  # 50 ms a copy
    got = checks(rows)
    assert got["into_256M_fetch_vs_memcpy"] == 2.0 and "into_256M_vs_memcpy" not in got
    gib = 1 << 30
    gpu_rows = [{"case": "rdt cuda_ipc fetch cuda -> cuda, into= (reused)", "size": gib, "gb_s": 100.0},
                {"case": "raw CUDA IPC: mapped once, copy_", "size": gib, "gb_s": 150.0}]
    assert gpu.checks(gpu_rows) == {
        "rdt cuda_ipc fetch cuda -> cuda, into= (reused) / raw CUDA IPC: mapped once, copy_ (>= 64 MiB)": {"1 GiB": 1.5}}
    nixl = pytest.importorskip("rdt_async.bench._nixl")
    summary = nixl._summary([
        {"case": "raw NIXL READ (2 processes, no Ray)", "size": size, "seconds": 0.04, "gib_s": 6.25},
        {"case": "rdt nixl transport, into= (2 processes)", "size": size, "seconds": 0.05, "gib_s": 5.0},
        {"case": "rdt.get nixl, into= (actor -> driver)", "size": size, "seconds": 0.05, "gib_s": 5.0},
        {"case": "ray RDT nixl (actor -> actor arg)", "size": size, "seconds": 0.25, "gib_s": 1.0}])
    assert [(r["case"], r["ratio"]) for r in summary] == [
        ("check: 256M transport time / raw (target <= 1.25)", 1.25), ("check: 256M rdt.get time / ray RDT (target <= 0.333)", 0.2)]


def test_the_fanout_across_hosts_keeps_a_broken_paths_passes_and_the_others_run_on(monkeypatch):
    """A pass that raises (an actor killed) ended the whole fan-out across hosts with no
    row; now that path says what broke after the passes it finished, the others run on."""
    import ray

    from rdt_async.bench import _fanout

    monkeypatch.setattr(ray, "get", lambda x, timeout=None: x)
    monkeypatch.setattr(time, "sleep", lambda s: None)
    into_passes = []

    def loader(side):
        def load(refs, size, into):
            if into:
                into_passes.append(size)
                if len(into_passes) > 12:  # into='s fourth pass (round 3), 4 loaders each
                    raise RuntimeError("a loader died")
            return float(max(1, size // 4 // _fanout.PARTS) * _fanout.PARTS), 0.001, 0.0005, "relay" if into else "tcp"
        actor = type("Loader", (), {})()
        actor.load = _Call(load)
        return actor

    trainer = type("Trainer", (), {})()
    trainer.publish, trainer.publish_plain = _Call(lambda size: "ref"), _Call(lambda size: "ref")
    loaders = {"rdt": [loader("rdt") for _ in range(4)], "ray": [loader("ray") for _ in range(4)]}
    rows = {r["case"]: r for r in _fanout._size(trainer, loaders, MIB, repeat=3)}
    assert set(rows) == set(_fanout.PATHS)
    into = rows["rdt auto, into="]
    assert into["broke"] == "round 3: RuntimeError: a loader died" and len(into["passes_s"]) == 2
    assert into["relayed"] == 4 and into["link_transfers"] == 0
    for case in ("rdt auto", _fanout.RAY_ZERO_COPY):
        assert "broke" not in rows[case] and len(rows[case]["passes_s"]) == 3 and len(rows[case]["turns"]) == 4
    assert rows["rdt auto"]["link_transfers"] == 4 and "vs_ray_zero_copy" in into


def test_a_bench_read_sums_words_not_bytes(monkeypatch):
    """torch sums uint8 one byte at a time (64 MiB: 0.32 s here, against 6.5 ms as int64
    words): the bench's read of every byte took longer than the transfers it timed."""
    import torch

    from rdt_async.bench._core import read_all

    summed = []
    real = torch.Tensor.sum

    def sum_(self, *args, **kwargs):
        summed.append((self.dtype, self.numel()))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sum", sum_)
    read_all(torch.full((1 << 20,) , 7, dtype=torch.uint8), 7)
    assert [n for dtype, n in summed if dtype == torch.uint8] == [0]  # (the empty tail only)
    assert (torch.int64, 1 << 17) in summed

"""Without the optional packages: the examples and the bench run, and say what is missing.

A newcomer's environment has none of the extras (`nixl`, `ucxx`, `bench`). Rather than a
second virtual environment, each run here is a fresh interpreter with
tests/without_optional on PYTHONPATH and RDT_HIDE_PACKAGES naming what to hide: its
`sitecustomize` makes those packages absent from the driver and from every Ray worker
it starts (they inherit its environment). Each run starts its own local Ray, as a user's
`python examples/quickstart.py` does: these tests take the cluster fixture of no one.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

# Each test starts a local Ray of its own, as a user's script does (~10 s on 2 idle cores;
# several times that on a loaded machine).
pytestmark = pytest.mark.timeout(600)

REPO = pathlib.Path(__file__).resolve().parents[1]
HIDER = pathlib.Path(__file__).resolve().parent / "without_optional"
NOT_INSTALLED = ("nixl", "ucxx")


def _env(hidden: tuple[str, ...]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RDT_"))}  # as a user's shell
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(HIDER), str(REPO), os.environ.get("PYTHONPATH"))))
    env["RDT_HIDE_PACKAGES"] = ",".join(hidden)
    return env


def _run(args: list[str], hidden: tuple[str, ...] = NOT_INSTALLED, timeout: float = 540) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=_env(hidden), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-5000:]
    return done


def test_the_hider_hides_the_packages_from_the_driver_and_from_ray_workers():
    probe = (
        "import importlib.util, json, ray, rdt_async as rdt\n"
        "def probe():\n"
        "    return [importlib.util.find_spec(p) is None for p in ('nixl', 'ucxx', 'torch')], rdt.available_transports()\n"
        "ray.init(address='local', include_dashboard=False)\n"
        "try:\n"
        "    print(json.dumps([probe(), ray.get(ray.remote(probe).remote())]))\n"
        "finally:\n"
        "    ray.shutdown()\n"
    )
    done = _run(["-c", probe])
    here, there = json.loads(done.stdout.strip().splitlines()[-1])
    for hidden, transports in (here, there):
        assert hidden == [True, True, False]
        for name in NOT_INSTALLED:  # rdt.available_transports() says why, and what adds it
            assert transports[name] == f"the {name} package is not installed: pip install 'rdt_async[{name}]'"
        assert transports["shm"] is True and transports["auto"] is True


EXAMPLES = {
    "quickstart.py": [r"^the ref holds: RDTObject", r"^server loaded step 1, checksum -?[\d.]+$",
                      r"^server fetched steps \[2, 3\] over \{.*\}$", r"^driver got torch.Size\(\[1024, 1024\]\)$"],
    "weight_sync.py": [r"^server 0: versions \[[\d, ]*3\], each exact, loaded in \d+ ms at most$",
                       r"^trainer: 4 versions of 32 MiB, the longest publish took [\d.]+ ms; it waited for no server$",
                       r"^served versions: \[3\]$"],
    "kv_handoff.py": [r"^request 0: 16 MiB of KV cache into slot 0 [\d.]+ ms after decode asked, exact, no allocation;"],
    "pipeline.py": [r"^8 micro-batches of 256x1024 through 3 stages in \d+ ms, all match a local forward pass$"],
    "data_parallel.py": [r"^step 2: \|avg grad\| = [\d.]+, same as by hand: True, model checksums \["],
    "custom_transport.py": [r"^server fetched over: \{'spool': \d+\}$", r"^objects the trainer still holds: 0$"],
}


def test_every_example_is_covered():
    assert sorted(p.name for p in (REPO / "examples").glob("*.py")) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_example_runs_without_the_optional_packages_and_prints_what_it_claims(name):
    done = _run([f"examples/{name}"])
    for pattern in EXAMPLES[name]:
        assert re.search(pattern, done.stdout, re.M), f"{pattern!r} not in:\n{done.stdout}\n{done.stderr[-3000:]}"


def test_the_bench_without_the_optional_packages_writes_rows_that_say_what_is_missing(tmp_path):
    """Before: ZeroDivisionError in `_in_turns` once every path of a group was missing, nothing written."""
    out = tmp_path / "bench"
    done = _run(["-m", "rdt_async.bench", "--only", "e2e,nixl,ucxx", "--e2e-sizes", "4K", "--repeat", "1",
                 "--e2e-fanouts", "", "--no-progress", "--out", str(out),
                 "--e2e-paths", "rdt auto,rdt nixl,rdt ucxx,ray rdt nixl"],
                hidden=(*NOT_INSTALLED, "matplotlib", "tqdm"))
    result = json.loads((out / "results.json").read_text())
    skipped = {(r["bench"], r["case"]): r["skipped"] for r in result["rows"] if "skipped" in r}
    assert skipped == {
        ("e2e", "rdt nixl"): "nixl is not installed (`pip install 'rdt_async[nixl]'` adds it)",
        ("e2e", "rdt ucxx"): "ucxx is not installed (`pip install 'rdt_async[ucxx]'` adds it)",
        ("e2e", "ray rdt nixl"): "nixl is not installed (`pip install 'rdt_async[nixl]'` adds it)",
        ("nixl", "every case"): "nixl is not installed (`pip install 'rdt_async[nixl]'` adds it)",
        ("ucxx", "every case"): "ucxx is not installed (`pip install 'rdt_async[ucxx]'` adds it)",
    }
    auto = [r for r in result["rows"] if r["case"] == "rdt auto"]
    assert [(r["shape"], r["size"]) for r in auto] == [("kept", 4096), ("fresh", 4096)]
    assert all(r["seconds"] > 0 for r in auto)
    md = (out / "results.md").read_text()
    assert "| rdt nixl | not run: nixl is not installed (`pip install 'rdt_async[nixl]'` adds it) |" in md
    assert "| ray rdt nixl | not run: nixl is not installed" in md
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md"]  # no matplotlib: no plots
    assert "no plots: matplotlib is not installed (`pip install rdt_async[bench]` adds plots)" in done.stderr
    assert "e2e ray rdt nixl: not run: nixl is not installed" in done.stderr  # said as it runs, too

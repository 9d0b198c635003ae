"""Without the optional packages: the examples and the bench run, and say what is missing.

A newcomer's environment has none of the extras (`nixl`, `ucxx`, `bench`). Rather than a
second virtual environment, each run here is a fresh interpreter with
tests/without_optional on PYTHONPATH and RDT_HIDE_PACKAGES naming what to hide: its
`sitecustomize` makes those packages absent from the driver and from every Ray worker
it starts (they inherit its environment). These tests take the cluster fixture of no one.

The examples run as `__main__`, one after another, in one such interpreter that starts
one local Ray for all of them (without_optional/run_examples.py: an example's own
`ray.init()` and `ray.shutdown()` are no-ops there), not one Ray each: the same lines
checked, one Ray start instead of eight. The bench runs first there, as `python -m
rdt_async.bench` would (its own local Ray is that one too); the bench's extra (matplotlib,
tqdm) is hidden as well, as a newcomer has none of it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

# Each run starts a local Ray of its own, as a user's script does (~10 s on 2 idle cores;
# several times that on a loaded machine), and the examples' run takes a few minutes.
pytestmark = pytest.mark.timeout(600)

REPO = pathlib.Path(__file__).resolve().parents[1]
HIDER = pathlib.Path(__file__).resolve().parent / "without_optional"
NOT_INSTALLED = ("nixl", "ucxx")
HIDDEN = (*NOT_INSTALLED, "matplotlib", "tqdm")  # the `bench` extra's too


def _env(hidden: tuple[str, ...]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RDT_"))}  # as a user's shell
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(HIDER), str(REPO), os.environ.get("PYTHONPATH"))))
    env["RDT_HIDE_PACKAGES"] = ",".join(hidden)
    return env


def _run(args: list[str], hidden: tuple[str, ...], timeout: float = 540) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=_env(hidden), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-5000:]
    return done


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("without_optional") / "bench"


@pytest.fixture(scope="module")
def runs(bench_out):
    """The bench, the hiding probe and every example, run once in one interpreter on one local Ray."""
    scripts = [_bench(bench_out), PROBE, *(f"examples/{name}" for name in sorted(EXAMPLES))]
    done = _run([str(HIDER / "run_examples.py"), *scripts], hidden=HIDDEN)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _bench(out: pathlib.Path) -> str:
    """The bench's command line as run_examples.py takes it (`-m MODULE ARG...`)."""
    return shlex.join(["-m", "rdt_async.bench", "--only", "e2e,nixl,ucxx", "--e2e-sizes", "4K", "--repeat", "1",
                       "--e2e-fanouts", "", "--no-progress", "--out", str(out),
                       "--e2e-paths", "rdt auto,rdt nixl,rdt ucxx,ray rdt nixl"])


def _output(runs, script: str) -> str:
    run = runs[script]
    assert run["error"] is None, f"{script} raised:\n{run['error']}\n{run['stdout'][-3000:]}"
    return run["stdout"]


PROBE = "tests/without_optional/probe_hiding.py"


def test_the_hider_hides_the_packages_from_the_driver_and_from_ray_workers(runs):
    here, there = json.loads(_output(runs, PROBE).strip().splitlines()[-1])
    for hidden, transports in (here, there):
        assert hidden == [True, True, False]
        for name in NOT_INSTALLED:  # rdt.available_transports() says why, and what adds it
            assert transports[name] == f"the {name} package is not installed: pip install 'rdt_async[{name}]'"
        assert transports["shm"] is True and transports["auto"] is True


EXAMPLES = {
    "quickstart.py": [r"^the ref holds: RDTObject", r"^server loaded step 1, checksum -?[\d.]+$",
                      # (the two fetches of load_many alone, not the server's every fetch so far)
                      r"^server fetched steps \[2, 3\] over \{'shm': 2\}$", r"^driver got torch.Size\(\[1024, 1024\]\)$"],
    "weight_sync.py": [r"^server 0: versions \[[\d, ]*3\], each exact, loaded in \d+ ms at most$",
                       r"^trainer: 4 versions of 32 MiB, the longest publish took [\d.]+ ms; it waited for no server$",
                       r"^served versions: \[3\]$"],
    "kv_handoff.py": [r"^request 0: 16 MiB of KV cache into slot 0 [\d.]+ ms after decode asked, exact, no allocation;",
                      r"^\d of 6 status calls were answered while a cache arrived$"],
    "pipeline.py": [r"^8 micro-batches of 256x1024 through 3 stages in \d+ ms, all match a local forward pass$"],
    "data_parallel.py": [r"^step 2: \|avg grad\| = [\d.]+, same as by hand: True, model checksums \["],
    # (also its only run: tests/test_custom_transport.py runs its transport, not its main)
    "custom_transport.py": [r"^server loaded \(sum of w, step, sum of layer 0\): \(30\.0, 2, 2\.0\)$",
                            r"^server fetched w\[1\]: \[6\.0, 8\.0, 10\.0\]$",
                            r"^server fetched over: \{'spool': 2\}$", r"^objects the trainer still holds: 0$"],
}


def test_every_example_is_covered():
    assert sorted(p.name for p in (REPO / "examples").glob("*.py")) == sorted(EXAMPLES)


def _constants(name: str):
    """The example's module-level names (its top level only runs: classes, constants; no Ray)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / "examples" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_example_runs_without_the_optional_packages_and_prints_what_it_claims(runs, name):
    out = _output(runs, f"examples/{name}")
    for pattern in EXAMPLES[name]:
        assert re.search(pattern, out, re.M), f"{pattern!r} not in:\n{out}"
    MORE.get(name, lambda out: None)(out)


def _weight_sync(out: str) -> None:
    """Every server sees newer versions, each exact, up to the last, while requests are answered."""
    example = _constants("weight_sync.py")
    last = example.VERSIONS - 1
    servers = re.findall(r"^server (\d): versions \[([\d, ]+)\], each exact, loaded in (\d+) ms at most$", out, re.M)
    assert [int(i) for i, _, _ in servers] == list(range(example.SERVERS)), out
    for _, versions, _ in servers:  # newer each time, up to the last (a slow server skips some)
        seen = [int(v) for v in versions.split(", ")]
        assert seen == sorted(set(seen)) and seen[-1] == last, out
    trainer = re.search(r"^trainer: 4 versions of 32 MiB, the longest publish took ([\d.]+) ms; it waited for no server$",
                        out, re.M)
    assert trainer and float(trainer[1]) < 5000, out
    rounds = re.search(r"^(\d+) request rounds answered meanwhile, slowest ([\d.]+) ms$", out, re.M)
    assert rounds and int(rounds[1]) >= 1 and float(rounds[2]) < 1000, out  # no request waited for a whole load
    assert f"served versions: [{last}]" in out


def _kv_handoff(out: str) -> None:
    """Every cache lands exactly in the decode actor's reused slots."""
    example = _constants("kv_handoff.py")
    lines = re.findall(
        r"request (\d+): 16 MiB of KV cache into slot (\d) ([\d.]+) ms after decode asked, exact, no allocation; "
        r"a status call sent meanwhile took ([\d.]+) ms, answered "
        r"(before decode asked for the cache|while the cache arrived|after the cache had landed)$",
        out, re.M,
    )
    assert [(int(r), int(s)) for r, s, *_ in lines] == [(r, r % example.SLOTS) for r in range(example.REQUESTS)], out
    # The count it prints is what its lines say (it claimed every call "meanwhile", unchecked).
    during = sum(when == "while the cache arrived" for *_, when in lines)
    assert f"{during} of {example.REQUESTS} status calls were answered while a cache arrived" in out, out


def _data_parallel(out: str) -> None:
    """Three steps, each the same as averaging by hand, every replica the same model."""
    steps = re.findall(r"step (\d): \|avg grad\| = [\d.]+, same as by hand: (\w+), model checksums \[(.*)\]", out)
    assert [s[0] for s in steps] == ["0", "1", "2"], out
    assert all(same == "True" and len(set(sums.split(", "))) == 1 for _, same, sums in steps), out


MORE = {"weight_sync.py": _weight_sync, "kv_handoff.py": _kv_handoff, "data_parallel.py": _data_parallel}


def test_data_parallel_prints_the_norm_of_the_whole_gradient():
    """|avg grad| is the gradient's norm (the root of every element's square, summed), not
    the sum of each parameter tensor's norm, which it printed."""
    import torch

    example = _constants("data_parallel.py")
    grads = {"0.weight": torch.tensor([[3.0, 0.0]]), "0.bias": torch.tensor([0.0]), "2.weight": torch.tensor([4.0])}
    assert example.grad_norm(grads) == 5.0  # sqrt(9 + 16): the sum of the norms is 7
    flat = torch.randn(100)
    parts = {"a": flat[:30].reshape(5, 6), "b": flat[30:]}
    assert example.grad_norm(parts) == pytest.approx(float(flat.norm()), rel=1e-6)


def test_the_bench_without_the_optional_packages_writes_rows_that_say_what_is_missing(runs, bench_out):
    """Before: ZeroDivisionError in `_in_turns` once every path of a group was missing, nothing written."""
    out = bench_out
    run = runs[_bench(out)]
    assert run["error"] is None, f"the bench raised:\n{run['error']}\n{run['stderr'][-3000:]}"
    assert "Traceback" not in run["stderr"], run["stderr"][-5000:]
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
    assert [(r["shape"], r["size"]) for r in auto] == [("kept", 4096), ("plain", 4096), ("fresh", 4096)]
    assert all(r["seconds"] > 0 for r in auto)
    md = (out / "results.md").read_text()
    assert "| rdt nixl | not run: nixl is not installed (`pip install 'rdt_async[nixl]'` adds it) |" in md
    assert "| ray rdt nixl | not run: nixl is not installed" in md
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md"]  # no matplotlib: no plots
    assert "no plots: matplotlib is not installed (`pip install rdt_async[bench]` adds plots)" in run["stderr"]
    assert "e2e ray rdt nixl: not run: nixl is not installed" in run["stderr"]  # said as it runs, too

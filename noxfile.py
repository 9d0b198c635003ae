"""Sessions: `nox -s quickstart` (install and run the example), `nox -s tests`, `nox -s lint`,
`nox -s bench`, `nox -s docs`.

torch: on a machine without an NVIDIA GPU the sessions install the CPU build of torch
(a plain `torch` requirement would pull several GB of CUDA wheels); with a GPU they let
pip pick the default build. Set RDT_TORCH_SPEC (e.g. "torch==2.13.0") to choose yourself.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import tempfile
import tomllib

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = False
# nox looks for uv, an optional installer these sessions do not use, and says so on every run.
logging.getLogger("nox").addFilter(lambda record: record.getMessage() != "uv binary not found.")

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyproject.toml"), "rb") as _f:
    PYPROJECT = tomllib.load(_f)
# The oldest Python the package supports (`requires-python`): lint checks the code there.
MIN_PYTHON = re.fullmatch(r">=\s*(\d+\.\d+)", PYPROJECT["project"]["requires-python"].split("#")[0].strip()).group(1)
LINTERS = ["ruff==0.17.6", "mypy==2.4.1"]

TORCH_VERSION = os.environ.get("RDT_TORCH_VERSION", "2.13.0")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidia0")


def _install_torch(session: nox.Session) -> None:
    """Install torch first, pinned, so that nothing later swaps it for a CUDA build."""
    spec = os.environ.get("RDT_TORCH_SPEC")
    if spec:
        session.install(spec)
    elif _has_gpu():
        session.install(f"torch=={TORCH_VERSION}")
    else:
        try:  # a local CPU wheel (find-links) or an index that serves +cpu builds
            session.install(f"torch=={TORCH_VERSION}+cpu", silent=True)
        except nox.command.CommandFailed:
            session.install(f"torch=={TORCH_VERSION}+cpu", "--index-url", CPU_INDEX)
    version = session.run(
        "python", "-c", "import importlib.metadata as m; print(m.version('torch'))", silent=True
    ).strip().splitlines()[-1]
    constraints = session.create_tmp() + "/constraints.txt"
    with open(constraints, "w") as f:
        f.write(f"torch=={version}\n")
    session.env["PIP_CONSTRAINT"] = constraints
    # create_tmp points TMPDIR into the virtualenv, where Ray refuses to keep its files.
    session.env["TMPDIR"] = tempfile.gettempdir()


@nox.session
def quickstart(session: nox.Session) -> None:
    """Install rdt_async on a fresh venv and run examples/quickstart.py."""
    _install_torch(session)
    session.install(".")
    # Token auth, Ray's default for a new local cluster, chosen explicitly: Ray then starts
    # without warning that it picked it (set RAY_AUTH_MODE yourself to choose otherwise).
    session.run("python", "examples/quickstart.py", env={"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")})


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite on a local two-node Ray cluster."""
    _install_torch(session)
    # nixl and ucxx ship Linux wheels only; elsewhere their tests skip and say why.
    session.install(".[tests,nixl,ucxx]" if sys.platform == "linux" else ".[tests]")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *_workers(), *session.posargs)


def _workers() -> list[str]:
    """pytest-xdist's options: RDT_TEST_WORKERS workers (default `auto`: one per core this
    process may use, 2 to 4; `1`: one process), each with a Ray cluster and test hosts of
    its own, a module to one worker. On 2 cores two workers ran the suite in 885-1000 s,
    one process in ~1310 s. The loop-lag probe (tests/probes.py) leaves out the time a loop
    waited because the machine gave no core to its thread or to a Python thread of ours
    that held the GIL, and names the thread that ran and any garbage collection meanwhile."""
    asked = os.environ.get("RDT_TEST_WORKERS", "auto")
    if asked in ("", "0", "1"):
        return []
    if asked == "auto":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        asked = str(min(max(cores, 2), 4))
    return ["-n", asked, "--dist", "loadfile", "--no-loadscope-reorder"]  # the order tests/conftest.py gives


@nox.session
def bench(session: nox.Session) -> None:
    """Run the benchmarks; tables, JSON and plots to bench-results/, JSON also to bench.json."""
    _install_torch(session)
    # nixl and ucxx for their baselines too (Linux wheels only); `bench`: progress bar, plots.
    session.install(".[bench,nixl,ucxx]" if sys.platform == "linux" else ".[bench]")
    session.run("python", "-m", "rdt_async.bench", "--out", "bench-results", "--json", "bench.json", *session.posargs)


@nox.session(python=MIN_PYTHON)
def lint(session: nox.Session) -> None:
    """ruff and `mypy --strict` (their settings: pyproject.toml), on the oldest supported Python.

    The package is installed and imported there too, so code newer than `requires-python`
    fails here rather than on a user's machine.
    """
    _install_torch(session)
    session.install(".[bench]", *LINTERS)
    session.run("python", "-c", "import rdt_async, rdt_async.bench, rdt_async.collective, rdt_async.transports")
    session.run("ruff", "check", "rdt_async", "tests", "examples", "noxfile.py", "docs")
    session.run("mypy", "rdt_async")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the docs site strictly (a warning fails it) into a temporary directory.

    Installs the `docs` extra's requirements only, not rdt_async: mkdocstrings reads the
    sources statically, so neither torch nor Ray is needed. `nox -s docs -- DIR` builds
    into DIR instead (keep it outside the repository).
    """
    session.install(*PYPROJECT["project"]["optional-dependencies"]["docs"])
    site = session.posargs[0] if session.posargs else tempfile.mkdtemp(prefix="rdt_async-site-")
    session.env["NO_MKDOCS_2_WARNING"] = "1"  # mkdocs-material's banner about MkDocs 2.0
    session.run("python", "-m", "mkdocs", "build", "--strict", "-f", "docs/mkdocs.yml", "-d", site)
    session.log(f"built into {site}")

"""Sessions: `nox -s quickstart` (install and run the example), `nox -s tests`, `nox -s bench`.

torch: on a machine without an NVIDIA GPU the sessions install the CPU build of torch
(a plain `torch` requirement would pull several GB of CUDA wheels); with a GPU they let
pip pick the default build. Set RDT_TORCH_SPEC (e.g. "torch==2.13.0") to choose yourself.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = False
# nox looks for uv, an optional installer these sessions do not use, and says so on every run.
logging.getLogger("nox").addFilter(lambda record: record.getMessage() != "uv binary not found.")

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
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Run the benchmarks; tables, JSON and plots to bench-results/, JSON also to bench.json."""
    _install_torch(session)
    # nixl and ucxx for their baselines too (Linux wheels only); `bench`: progress bar, plots.
    session.install(".[bench,nixl,ucxx]" if sys.platform == "linux" else ".[bench]")
    session.run("python", "-m", "rdt_async.bench", "--out", "bench-results", "--json", "bench.json", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the docs site strictly (a warning fails it) into a temporary directory.

    Installs the `docs` extra's requirements only, not rdt_async: mkdocstrings reads the
    sources statically, so neither torch nor Ray is needed. `nox -s docs -- DIR` builds
    into DIR instead (keep it outside the repository).
    """
    import tomllib

    with open("pyproject.toml", "rb") as f:
        requirements = tomllib.load(f)["project"]["optional-dependencies"]["docs"]
    session.install(*requirements)
    site = session.posargs[0] if session.posargs else tempfile.mkdtemp(prefix="rdt_async-site-")
    session.env["NO_MKDOCS_2_WARNING"] = "1"  # mkdocs-material's banner about MkDocs 2.0
    session.run("python", "-m", "mkdocs", "build", "--strict", "-f", "docs/mkdocs.yml", "-d", site)
    session.log(f"built into {site}")

"""Run a script in a process of its own, without paying for torch's import again.

`run(code)` is `subprocess.run([sys.executable, "-c", code])` for a script that needs a
process of its own (one that loads ucxx's UCX, which must not meet the NIXL of the pytest
process; one that sets UCX's variables before UCX reads them): the process is forked from
the contract harness's forkserver (`transports.contract._context`), which imported torch
and rdt_async once (~2 CPU-seconds a `python -c` paid again) and no transport's package,
CUDA or thread. The script gets the environment, arguments and working directory given,
its stdout and stderr at the descriptors (what UCX prints too), and ends as an interpreter
does: its exit handlers run, an uncaught exception prints its traceback and exits 1.

`fork_producers=True`: the script's contract producers (`transports.contract.Producer`)
fork from the script's process, not from a forkserver of its own (another interpreter that
imports torch). Only for a script that makes its producers before it starts a thread or
loads a transport's package: what it patched by then, its producers inherit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def run(
    code: str,
    env: Mapping[str, str] | None = None,
    argv: Sequence[str] = (),
    timeout: float = 300,
    cwd: str = ROOT,
    fork_producers: bool = False,
) -> subprocess.CompletedProcess[str]:
    """The script's exit status, stdout and stderr, as `subprocess.run(..., capture_output=True, text=True)`."""
    from transports.contract import _context

    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="fresh-") as d:
        out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        proc = ctx.Process(
            target=_main,
            args=(code, dict(os.environ if env is None else env), list(argv), cwd, out, err, fork_producers),
        )
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
            raise subprocess.TimeoutExpired(["-c", code], timeout, _read(out), _read(err))
        return subprocess.CompletedProcess(["-c", code, *argv], proc.exitcode, _read(out), _read(err))


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:  # (the process died before it opened it)
        return ""


def _main(
    code: str, env: dict[str, str], argv: list[str], cwd: str, out: str, err: str, fork_producers: bool
) -> None:
    """In the forked process: become `python -c code *argv` in `env` and `cwd`."""
    import atexit
    import io
    import traceback

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = ["-c", *argv]
    sys.path[:0] = [p for p in ("", TESTS) if p not in sys.path]  # (-c's first entry; the tests' helpers)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False))
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True)
    if fork_producers:
        import multiprocessing

        from transports import contract

        contract._context = lambda: multiprocessing.get_context("fork")
    status = 0
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(status)

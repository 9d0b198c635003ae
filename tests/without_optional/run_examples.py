"""Run examples as `__main__`, one after another, in this interpreter on one local Ray.

`python run_examples.py PATH...` (from the repository root, with this directory on
PYTHONPATH and RDT_HIDE_PACKAGES set, as tests/test_without_optional.py runs it) starts one
local Ray instance, then runs each script PATH as `python PATH` would, except
that the example's own `ray.init()` and `ray.shutdown()` do nothing: it uses the instance
this script started (one Ray start for all, not one each). A PATH of the form
"-m MODULE ARG..." runs MODULE as `python -m MODULE ARG...` would (the bench: its
`ray_cluster(1)` takes that instance too). Each one's stdout is kept apart, and a
module's stderr (an example's goes to this process's); a failing one fails alone (a
SystemExit of 0 is no failure). The last line of stdout is a JSON object:
{PATH: {"stdout": ..., "stderr": ... (a module's; "" for a script), "error": traceback
or null, "seconds": how long it ran}}.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import runpy
import shlex
import sys
import time
import traceback

import ray


def main(names: list[str]) -> dict[str, dict[str, object]]:
    # As many CPUs as the most any example asks for (data_parallel.py: 4 workers).
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    init, shutdown = ray.init, ray.shutdown
    ray.init = lambda *args, **kwargs: None  # type: ignore[assignment]
    ray.shutdown = lambda *args, **kwargs: None  # type: ignore[assignment]
    results: dict[str, dict[str, object]] = {}
    try:
        for name in names:
            out, err = io.StringIO(), io.StringIO()
            error, t0 = None, time.perf_counter()
            try:
                with contextlib.redirect_stdout(out):
                    if name.startswith("-m "):
                        module, *args = shlex.split(name[3:])
                        sys.argv = [module, *args]
                        with contextlib.redirect_stderr(err):
                            runpy.run_module(module, run_name="__main__", alter_sys=True)
                    else:
                        sys.argv = [name]
                        runpy.run_path(name, run_name="__main__")
            except SystemExit as exc:  # the example's failure, reported; exit 0 is none
                if exc.code not in (0, None):
                    error = traceback.format_exc()
            except BaseException:
                error = traceback.format_exc()
            results[name] = {"stdout": out.getvalue(), "stderr": err.getvalue(), "error": error,
                             "seconds": round(time.perf_counter() - t0, 2)}
            gc.collect()  # the example's actors go with its last handle, as at its exit
    finally:
        ray.init, ray.shutdown = init, shutdown
        ray.shutdown()
    return results


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))

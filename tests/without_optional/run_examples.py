"""Run examples as `__main__`, one after another, in this interpreter on one local Ray.

`python run_examples.py PATH...` (from the repository root, with this directory on
PYTHONPATH and RDT_HIDE_PACKAGES set, as tests/test_without_optional.py runs it) starts one
local Ray instance, then runs each script PATH as `python PATH` would, except
that the example's own `ray.init()` and `ray.shutdown()` do nothing: it uses the instance
this script started (one Ray start for all, not one each). Each example's stdout is kept
apart; a failing example fails alone. The last line of stdout is a JSON object:
{PATH: {"stdout": ..., "error": traceback or null, "seconds": how long it ran}}.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import runpy
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
            out = io.StringIO()
            error, t0 = None, time.perf_counter()
            try:
                sys.argv = [name]
                with contextlib.redirect_stdout(out):
                    runpy.run_path(name, run_name="__main__")
            except BaseException:  # SystemExit too: the example's failure, reported
                error = traceback.format_exc()
            results[name] = {"stdout": out.getvalue(), "error": error, "seconds": round(time.perf_counter() - t0, 2)}
            gc.collect()  # the example's actors go with its last handle, as at its exit
    finally:
        ray.init, ray.shutdown = init, shutdown
        ray.shutdown()
    return results


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))

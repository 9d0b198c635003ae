"""A container's small /dev/shm (Docker's default 64 MiB): rdt.Publisher keeps the slots
that fit, or says what to change; it never dies of a full tmpfs.

The run is a process of its own under `unshare -m` with a 64 MiB tmpfs over /dev/shm (as
a container has), starting its own local Ray: this test takes the cluster fixture of no one.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

SCRIPT = pathlib.Path(__file__).resolve().parent / "small_shm" / "cramped_publisher.py"
REPO = SCRIPT.parents[2]


def test_a_publisher_in_a_container_with_64_mib_of_dev_shm_keeps_the_slots_that_fit_or_says_why():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to give a process a small /dev/shm")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RDT_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    shell = f"mount --make-rprivate / && mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} {SCRIPT}"
    done = subprocess.run(["unshare", "-m", "sh", "-c", shell], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-5000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    first, second = out["too big"]
    assert first == "version 0" and out["too big stats"] == {"slots": 1, "version": 0}, out
    assert second.startswith("RuntimeError: /dev/shm has no room for slot 2 of rdt.Publisher 'big' (40.0 MiB; "), out
    assert second.endswith(
        "a publisher keeps at least 2 copies of the state dict there; give it more (Docker: `docker run "
        "--shm-size=...`; Kubernetes: an emptyDir volume with medium Memory at /dev/shm)"
    ), out
    assert out["two fit"] == ["version 0", "version 1", "version 2"] and out["held"] == 0 and out["waited"], out
    assert out["small stats"] == {"slots": 2, "version": 2}, out
    assert len(out["said"]) == 1 and "has no room for slot 3 of rdt.Publisher 'small' (24.0 MiB" in out["said"][0], out
    assert "publishing with 2 slots instead of 3" in out["said"][0], out
    assert out["read"] == [2, [2.0]], out

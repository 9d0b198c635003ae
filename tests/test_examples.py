"""The examples run as they are, on the session's cluster, and say what a user wants to see."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import pytest
import ray.cloudpickle

pytestmark = pytest.mark.usefixtures("ray_session")

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)  # workers do not have examples/ on their path
    return module


def test_weight_sync_publishes_every_version_exactly_while_servers_answer(capsys):
    example = _load("weight_sync")
    example.main()
    out = capsys.readouterr().out
    lines = re.findall(
        r"version (\d+): 3 servers loaded 32 MiB in (\d+) ms, exact; (\d+) request rounds meanwhile, "
        r"slowest ([\d.]+) ms; the trainer waited ([\d.]+) ms to write",
        out,
    )
    assert [int(v) for v, *_ in lines] == list(range(example.VERSIONS)), out
    assert sum(int(rounds) for _, _, rounds, _, _ in lines) >= 1, out  # requests were answered during loads
    assert all(float(slowest) < 1000 for *_, slowest, _ in lines), out  # no request waited for a whole load
    assert f"served versions: [{example.VERSIONS - 1}]" in out


def test_kv_handoff_lands_every_cache_exactly_in_the_decode_actors_reused_slots(capsys):
    example = _load("kv_handoff")
    example.main()
    out = capsys.readouterr().out
    lines = re.findall(
        r"request (\d+): 16 MiB of KV cache into slot (\d) ([\d.]+) ms after decode asked, exact, no allocation; "
        r"a status call meanwhile took ([\d.]+) ms",
        out,
    )
    assert [(int(r), int(s)) for r, s, _, _ in lines] == [(r, r % example.SLOTS) for r in range(example.REQUESTS)], out


def test_pipeline_matches_a_local_forward_pass(capsys):
    example = _load("pipeline")
    example.main()
    out = capsys.readouterr().out
    assert re.search(r"^8 micro-batches of 256x1024 through 3 stages in \d+ ms, all match a local forward pass$", out, re.M), out

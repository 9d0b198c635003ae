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

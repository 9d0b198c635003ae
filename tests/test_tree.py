"""Values of any nesting keep their structure through flatten/unflatten."""

from __future__ import annotations

import collections
import dataclasses
import pickle

import torch

from rdt_async import _tree

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    label: str
    extra: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: torch.Tensor
    b: int


def test_round_trip_keeps_structure_and_order():
    t = [torch.full((2,), float(i)) for i in range(6)]
    value = {
        "list": [t[0], 3, "s"],
        "tuple": (t[1], None),
        "nt": Point(t[2], 5),
        "dc": Batch(t[3], "lbl", {"inner": t[4]}),
        "frozen": Frozen(t[5], 9),
        "od": collections.OrderedDict(k=1),
    }
    skeleton, tensors = _tree.flatten(value)
    assert [x[0].item() for x in tensors] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    skeleton = pickle.loads(pickle.dumps(skeleton))  # it travels through Ray
    out = _tree.unflatten(skeleton, [x * 10 for x in tensors])
    assert out["list"][1:] == [3, "s"] and out["list"][0][0].item() == 0.0
    assert out["tuple"][0][0].item() == 10.0 and out["tuple"][1] is None
    assert isinstance(out["nt"], Point) and out["nt"].y == 5 and out["nt"].x[0].item() == 20.0
    assert isinstance(out["dc"], Batch) and out["dc"].label == "lbl" and out["dc"].extra["inner"][0].item() == 40.0
    assert isinstance(out["frozen"], Frozen) and out["frozen"].b == 9 and out["frozen"].a[0].item() == 50.0
    assert isinstance(out["od"], collections.OrderedDict) and out["od"] == {"k": 1}


def test_plain_values_have_no_tensors():
    skeleton, tensors = _tree.flatten({"a": [1, 2], "b": "x"})
    assert tensors == [] and _tree.unflatten(skeleton, []) == {"a": [1, 2], "b": "x"}

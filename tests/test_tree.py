"""Values of any nesting keep their structure through flatten/unflatten."""

from __future__ import annotations

import collections
import dataclasses
import pickle

import pytest
import torch

from rdt_async import _tree
from rdt_async._errors import TransferError

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


class Opaque:
    """Not a container `_tree` walks: its tensors are taken out of its pickle."""

    def __init__(self, a, b):
        self.a, self.b = a, b


def test_a_leaf_of_another_type_is_pickled_with_its_tensors_taken_out_once_each():
    t, u = torch.ones(3), torch.zeros(2)
    skeleton, tensors = _tree.flatten({"o": Opaque(t, [t, u]), "s": {u}, "x": 1, "none": Opaque(1, "x")})
    assert len(tensors) == 3 and tensors[0] is t and tensors[1] is u and tensors[2] is u  # (t twice in one leaf: once)
    assert repr(skeleton["o"]) == "<Opaque of 2 tensor(s)>" and isinstance(skeleton["none"], Opaque)
    skeleton = pickle.loads(pickle.dumps(skeleton))
    new = [torch.full((3,), 5.0), torch.full((2,), 6.0), torch.full((2,), 7.0)]
    out = _tree.unflatten(skeleton, new)
    assert out["o"].a is new[0] and out["o"].b[0] is new[0] and out["o"].b[1] is new[1]
    assert next(iter(out["s"])) is new[2] and out["x"] == 1 and out["none"].b == "x"


def test_a_packed_leaf_naming_tensors_it_does_not_have_is_refused():
    skeleton, tensors = _tree.flatten([Opaque(torch.ones(1), None)])
    bad = _tree.Packed(skeleton[0].data, (5,), "Opaque")  # (a skeleton from another process)
    with pytest.raises(TransferError, match=r"the value's skeleton names tensors \(5,\) of 1"):
        _tree.unflatten([bad], tensors)
    short = _tree.Packed(skeleton[0].data, (), "Opaque")
    with pytest.raises(TransferError, match="the value's Opaque names tensor 0 of 0"):
        _tree.unflatten([short], tensors)

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


class Pair(tuple):
    """A tuple subclass that is no namedtuple: a leaf to `flatten`."""


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


def test_a_tensor_under_two_names_takes_one_slot_only_where_asked_and_only_if_it_is_the_same():
    w = torch.arange(12.0).view(3, 4)
    value = {"emb": w, "mid": torch.ones(2), "head": w.detach(), "view": w[1:], "t": w.t(), "again": w.view(3, 4)}
    skeleton, tensors = _tree.flatten(value, tied=True)
    assert [s.index for s in skeleton.values()] == [0, 1, 0, 2, 3, 0]  # a view, a transpose: tensors of their own
    assert _tree.slot_order(skeleton) == [0, 1, 0, 2, 3, 0]
    back = _tree.unflatten(skeleton, tensors)
    assert back["emb"] is back["head"] is back["again"] and torch.equal(back["t"], w.t())
    assert [s.index for s in _tree.flatten(value)[0].values()] == [0, 1, 2, 3, 4, 5]  # not asked: each its own
    assert _tree.firsts([w, torch.ones(2), w.detach(), w[1:], torch.empty(0), torch.empty(0)]) == [0, 1, 0, 3, 4, 5]
    assert _tree.flatten([torch.empty(0), torch.empty(0)], tied=True)[0][1].index == 1  # no bytes: nothing shared


def test_into_takes_a_buffer_per_name_of_a_tied_tensor_and_copies_into_a_second_of_its_own():
    from rdt_async import _buffers
    from rdt_async.transports._base import TensorSpec

    w = torch.zeros(3, 4)
    skeleton, tensors = _tree.flatten({"emb": w, "mid": torch.zeros(2), "head": w.detach()}, tied=True)
    specs = [TensorSpec.of(t) for t in tensors]
    tied_model = {"emb": torch.zeros(3, 4), "mid": torch.zeros(2)}
    tied_model["head"] = tied_model["emb"]
    buffers, ordered, copies, _ = _buffers._checked(specs, tied_model, skeleton)
    assert [b.data_ptr() for b in buffers] == [tied_model["emb"].data_ptr(), tied_model["mid"].data_ptr()] and copies == []
    untied = {"emb": torch.zeros(3, 4), "mid": torch.zeros(2), "head": torch.zeros(3, 4)}
    buffers, ordered, copies, _ = _buffers._checked(specs, untied, skeleton)
    assert [(b.data_ptr(), k) for b, k in copies] == [(untied["head"].data_ptr(), 0)] and len(ordered) == 3
    assert len(_buffers._checked(specs, [untied["emb"], untied["mid"]], skeleton)[0]) == 2  # a buffer per tensor
    with pytest.raises(ValueError, match=r"into= holds 4 tensor\(s\) but the object has 2"):
        _buffers._checked(specs, [*untied.values(), torch.zeros(1)], skeleton)
    untied["head"] = torch.zeros(3, 4).to_sparse()  # no plain bytes to compare: checked as any buffer
    with pytest.raises(ValueError, match=r"into= tensor 2 \(into\['head'\]\) is a sparse_coo tensor"):
        _buffers._checked(specs, untied, skeleton)
    untied["head"] = untied["emb"][:, :2]  # not the object's shape
    with pytest.raises(ValueError, match=r"into= tensor 2 \(into\['head'\]\) is float32\[3, 2\]@cpu; the object's tensor 0 is float32\[3, 4\]@cpu"):
        _buffers._checked(specs, untied, skeleton)


def test_a_refused_buffer_is_named_by_where_it_lies_in_into():
    # `into=model.state_dict()` said "into= tensor 17": the user had to count to find it.
    from rdt_async import _buffers
    from rdt_async.transports._base import TensorSpec

    value = {"w": torch.zeros(1), "l": [torch.zeros(1), Point(torch.zeros(1), 3)], "b": Batch(torch.zeros(1), "x"),
             "n": 5, "last": torch.zeros(1)}  # fmt: skip
    assert [_tree.path(value, k) for k in range(5)] == ["['w']", "['l'][0]", "['l'][1].x", "['b'].x", "['last']"]
    assert _tree.path(torch.zeros(1), 0) == "" and _tree.path([torch.zeros(1)] * 3, 2) == "[2]"
    pair = Pair((torch.zeros(1), torch.zeros(1)))  # a tuple subclass: one leaf to flatten (pickled), so one place
    assert [_tree.path({"p": pair, "w": torch.zeros(1)}, k) for k in range(3)] == ["['p']", "['p']", "['w']"]
    specs = [TensorSpec((4,), torch.float32, "cpu", 16)] * 3
    model = {"layer0.weight": torch.zeros(4), "layer1.weight": torch.zeros(4, dtype=torch.bfloat16), "head": torch.zeros(4)}
    with pytest.raises(ValueError) as refused:
        _buffers.checked(specs, model)
    assert str(refused.value) == (
        "into= tensor 1 (into['layer1.weight']) is bfloat16[4]@cpu; the object's tensor 1 is float32[4]@cpu"
    )
    model["layer1.weight"] = model["head"]
    with pytest.raises(ValueError, match=r"^into= tensor 1 \(into\['layer1.weight'\]\) and tensor 2 \(into\['head'\]\) share memory"):
        _buffers.checked(specs, model)
    with pytest.raises(ValueError, match=r"^into= tensor 1 is bfloat16\[4\]@cpu"):  # a list: its place says it all
        _buffers.checked(specs, [torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4)])

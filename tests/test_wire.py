"""An RDTObject's wire form: what Ray pickles to every consumer (no cluster).

A producer's object travels as one msgpack record of its id, producer, transport and
specs, beside its skeleton, metadata and anchor (`_object._wire`). It must arrive as it
left, field for field; an object not as a producer makes it (a crafted one) travels field by
field as before, so that the consumer's checks see what was crafted; and a record no
producer made is refused with an error that says so.
"""

from __future__ import annotations

import collections
import copyreg
import dataclasses
import pickle

import msgpack
import pytest
import torch

from rdt_async import TransferError, _object
from rdt_async._object import Process, RDTObject
from rdt_async._tree import flatten
from rdt_async.transports._base import QUANTIZED, TensorSpec

# Every dtype a producer may send: all of torch's but the quantized (refused at return).
DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)} - QUANTIZED, key=str)


def _spec(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> TensorSpec:
    numel = 1
    for n in shape:
        numel *= n
    return TensorSpec(shape, dtype, device, numel * dtype.itemsize)


def _obj(specs: tuple[TensorSpec, ...] = (), producer: Process | None = None, **fields) -> RDTObject:
    skeleton, _ = flatten({"w": torch.zeros(1), "step": 3, "names": ["a", "b"]})
    base = {
        "obj_id": "0123456789abcdef01234567",
        "producer": producer or Process("ab" * 28, "4242:0a1b2c3d4e5f", "cd" * 16, b"\x80handle", True),
        "transport": "auto",
        "specs": specs,
        "skeleton": skeleton,
        "meta": {"inline": tuple(bytes(s.nbytes) for s in specs), "groups": {"g": ("gloo", 1)}},
        "eager": {},
        "anchor": None,
    }
    base.update(fields)
    return RDTObject(**base)


def _fields(obj: RDTObject) -> dict:
    """Every field, the producer's too (its `actor_state` and `serves` take no part in ==)."""
    out = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    out["producer"] = dataclasses.astuple(obj.producer)
    out["skeleton"] = repr(obj.skeleton)  # (its slots compare by identity)
    return out


def test_every_dtype_shape_and_producer_field_arrives_as_it_left():
    specs = tuple(_spec(shape, d) for d in DTYPES for shape in ((), (0,), (3, 5)))
    for producer in (None, Process("ef" * 28, "7:ff")):  # an actor's, and the driver's (no handle)
        obj = _obj(specs, producer)
        assert obj.__reduce_ex__(5)[0] is _object._rebuilt  # the record, not field by field
        back = pickle.loads(pickle.dumps(obj, protocol=5))
        assert _fields(back) == _fields(obj)
        assert [type(s.shape) for s in back.specs] == [tuple] * len(specs)
        assert all(b.dtype is s.dtype for b, s in zip(back.specs, specs))
        _object.check(back)  # as a producer makes it


@pytest.mark.parametrize(
    "crafted",
    [
        {"specs": [_spec((2,), torch.float32)]},  # a list, not a tuple
        {"specs": (TensorSpec([2], torch.float32, "cpu", 8),)},  # a shape that is a list
        {"specs": (TensorSpec((2,), "float32", "cpu", 8),)},  # a dtype that is a string
        {"specs": (TensorSpec((2.0,), torch.float32, "cpu", 8),)},  # a float in the shape
        {"obj_id": 12345},
        {"producer": Process("n", 4242)},  # a token that is not a string
    ],
)
def test_a_crafted_object_travels_field_by_field_and_the_consumer_refuses_it(crafted):
    obj = _obj(**{"specs": (_spec((2,), torch.float32),), **crafted})
    assert obj.__reduce_ex__(5)[0] is copyreg.__newobj__  # as a dataclass: what was crafted arrives
    back = pickle.loads(pickle.dumps(obj, protocol=5))
    assert _fields(back) == _fields(obj)
    with pytest.raises(TransferError, match=r"not one a producer makes|not a tuple"):
        _object.check(back)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"meta": ["shm"]}, "the ref's transport metadata is a list, not a dict by transport name"),
        ({"meta": {1: "x"}}, "the ref's transport metadata is a dict, not a dict by transport name"),
        ({"meta": {"groups": ["g"]}}, "the ref's collective groups ['g'] are not {name: (backend, rank)}"),
        ({"meta": {"groups": {"g": "gloo"}}}, "are not {name: (backend, rank)}"),
        ({"meta": {"groups": {"g": (1, 2)}}}, "are not {name: (backend, rank)}"),
        ({"specs": (TensorSpec((0, 1 << 63), torch.float32, "cpu", 0),)}, "tensor 0's spec is not one a producer makes: shape (0, 9223372036854775808)"),
    ],
)
def test_crafted_metadata_and_dims_are_refused_at_the_check(fields, words):
    back = pickle.loads(pickle.dumps(_obj(**{"specs": (_spec((2,), torch.float32),), **fields}), protocol=5))
    with pytest.raises(TransferError) as err:
        _object.check(back)
    assert words in str(err.value), err.value


@pytest.mark.parametrize("node", [12345, None, ["ab"], "n", "AB" * 28, "ab" * 27, "ab" * 29, "ab" * 27 + "g0"])
def test_a_producer_node_id_that_is_not_a_ray_node_id_is_refused(node):
    # (it keys what auto remembers of a node: an int, None or a list reached it as a TypeError)
    back = pickle.loads(pickle.dumps(_obj((_spec((2,), torch.float32),), Process(node, "7:ff")), protocol=5))
    with pytest.raises(TransferError, match=r"producer node id .* is not one a producer makes \(a Ray node id: 56 hex digits\): the ref was altered"):
        _object.check(back)


@pytest.mark.parametrize("token", ["9999999999:ff", "4194305:ff"])  # os.kill would overflow; past PID_MAX_LIMIT
def test_a_producer_token_naming_a_pid_no_process_has_is_refused(token):
    back = pickle.loads(pickle.dumps(_obj((_spec((2,), torch.float32),), Process("ef" * 28, token)), protocol=5))
    with pytest.raises(TransferError, match=f"producer token '{token}' is not one a producer makes"):
        _object.check(back)


@pytest.mark.parametrize(
    "producer",
    [Process("ef" * 28, "7:ff", None, None, True), Process("ef" * 28, "7:ff", "ab" * 16, None, True), Process("ef" * 28, "7:ff", None, b"x", True)],
    ids=["no-actor", "no-handle", "handle-of-no-actor"],
)
def test_a_producer_said_to_serve_without_an_actor_and_its_handle_is_refused(producer):
    back = pickle.loads(pickle.dumps(_obj((_spec((2,), torch.float32),), producer), protocol=5))
    with pytest.raises(TransferError, match="the ref says its producer is an rdt actor, but names no actor id and handle for it"):
        _object.check(back)


def _record(**change) -> bytes:
    obj = _obj(specs=(_spec((2,), torch.float32),))
    fields = list(msgpack.unpackb(_object._wire(obj)[0], use_list=False))
    names = ["version", "obj_id", "node_id", "token", "actor_id", "actor_state", "serves", "transport", "specs", "keys", "kind"]
    for name, value in change.items():
        fields[names.index(name)] = value
    return msgpack.packb(fields, use_bin_type=True)


@pytest.mark.parametrize(
    "wire",
    [
        b"\xc1",  # not msgpack
        b"\x93\x01\x02\x03",  # a record of 3 fields
        msgpack.packb({"obj_id": "x"}),
        _record(version=1),  # a version this build does not read
        _record(obj_id=5),
        _record(token=4242),
        _record(actor_state="not bytes"),
        _record(serves=1),
        _record(transport=None),
        _record(specs={"shape": 1}),
        _record(specs=((2, "float32", "cpu"),)),  # a spec of 3 fields
        _record(specs=((2, "float32", "cpu", 8),)),  # a shape that is not a sequence
        _record(specs=(((2,), {"a": 1}, "cpu", 8),)),  # a dtype name that is a map
        _record(keys="w"),  # a state dict's names that are not a sequence
        _record(keys=(1,)),  # a name that is not a string
        _record(keys=("w", "w")),  # two slots of one name for one tensor
        _record(keys=()),  # no name for the tensor
        _record(keys=("w",), kind=7),  # a kind of skeleton no producer writes
        _record(keys=("w",), kind=True),
        _record(keys=("w",), kind=None),
        _record(keys=None, kind=0),  # a kind without names
        _record(keys=("w",), kind=3),  # a lone tensor with a name
        _record(keys=None, kind=3),
        _record(keys=(), kind=3, specs=(((2,), "float32", "cpu", 8),) * 2),  # a lone tensor for two
    ],
)
def test_a_record_no_producer_made_is_refused_as_it_is_read(wire):
    with pytest.raises(TransferError, match=r"an RDTObject arrived in a form no producer makes.*unaltered"):
        _object._rebuilt(wire, None, {}, {}, None)


@pytest.mark.parametrize(
    "spec, why",
    [
        (((2,), "load", "cpu", 8), "dtype 'load'"),  # a name torch has, but no dtype
        (((2,), "float32", "cpu", 9), "spec is not one a producer makes"),
        (((-2,), "float32", "cpu", -8), "shape"),
        (((2,), "float32", "tpu:0", 8), "spec is not one a producer makes"),
        (((0, 1 << 50, 1 << 50), "float32", "cpu", 0), r"empty, but its other dimensions overflow a stride"),
    ],
)
def test_what_a_well_formed_record_holds_is_checked_before_a_fetch_uses_it(spec, why):
    back = _object._rebuilt(_record(specs=(spec,)), None, {}, {}, None)
    with pytest.raises(TransferError, match=why):
        _object.check(back)


def test_a_state_dict_travels_as_its_names_and_arrives_the_same_dict():
    from rdt_async._tree import unflatten

    state = {f"layer{i}.weight": torch.full((2,), float(i)) for i in range(200)}
    skeleton, tensors = flatten(state)
    obj = _obj(specs=tuple(TensorSpec.of(t) for t in tensors), skeleton=skeleton, meta={})
    rebuild, args = obj.__reduce_ex__(5)
    assert rebuild is _object._rebuilt and args[1] is None  # the names ride in the record
    back = pickle.loads(pickle.dumps(obj, protocol=5))
    assert type(back.skeleton) is dict and list(back.skeleton) == list(state)
    value = unflatten(back.skeleton, tensors)
    assert list(value) == list(state) and all(value[k] is t for k, t in zip(state, tensors))
    with pytest.raises(TransferError, match="a skeleton beside them"):
        _object._rebuilt(args[0], {"w": None}, {}, {}, None)  # a record's names and a skeleton too


def test_a_models_state_dict_travels_as_its_names_and_arrives_with_its_metadata():
    from rdt_async._tree import unflatten

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    state = model.state_dict()  # an OrderedDict whose `_metadata` holds each module's version
    skeleton, tensors = flatten(state)
    obj = _obj(specs=tuple(TensorSpec.of(t) for t in tensors), skeleton=skeleton, meta={})
    rebuild, args = obj.__reduce_ex__(5)
    assert rebuild is _object._rebuilt and args[1] == state._metadata  # the names ride in the record
    back = pickle.loads(pickle.dumps(obj, protocol=5))
    assert type(back.skeleton) is collections.OrderedDict and list(back.skeleton) == list(state)
    value = unflatten(back.skeleton, tensors)
    assert type(value) is collections.OrderedDict and value._metadata == {"": {"version": 1}, "0": {"version": 1}, "1": {"version": 2}}
    fresh = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    fresh.load_state_dict(value)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items())
    plain = collections.OrderedDict(w=torch.zeros(1))  # an OrderedDict of no module: no _metadata
    skeleton, tensors = flatten(plain)
    obj = _obj(specs=tuple(TensorSpec.of(t) for t in tensors), skeleton=skeleton, meta={})
    assert obj.__reduce_ex__(5)[1][1] is None
    back = pickle.loads(pickle.dumps(obj, protocol=5))
    assert type(back.skeleton) is collections.OrderedDict and not hasattr(back.skeleton, "_metadata")


def test_a_lone_tensor_travels_in_the_record_and_arrives_as_its_slot():
    from rdt_async._tree import Slot, unflatten

    t = torch.arange(3.0)
    skeleton, tensors = flatten(t)
    obj = _obj(specs=(TensorSpec.of(t),), skeleton=skeleton, meta={})
    rebuild, args = obj.__reduce_ex__(5)
    assert rebuild is _object._rebuilt and args[1] is None  # nothing pickled beside the record
    back = pickle.loads(pickle.dumps(obj, protocol=5))
    assert type(back.skeleton) is Slot and back.skeleton.index == 0 and unflatten(back.skeleton, tensors) is t
    with pytest.raises(TransferError, match="a lone tensor's skeleton"):
        _object._rebuilt(args[0], Slot(0), {}, {}, None)  # a record's lone tensor and a skeleton beside it
    two = _obj(specs=(TensorSpec.of(t),) * 2, skeleton=skeleton, meta={})  # one slot for two tensors
    assert two.__reduce_ex__(5)[1][1] is skeleton


def _odict_with(**attrs):
    out = collections.OrderedDict(w=torch.zeros(1))
    for k, v in attrs.items():
        setattr(out, k, v)
    return out


@pytest.mark.parametrize(
    "value",
    [
        {"b": torch.zeros(1), "a": {"nested": torch.zeros(1)}},  # not a flat dict of tensors
        {1: torch.zeros(1), 2: torch.zeros(1)},  # names that are not strings
        _odict_with(_metadata={}, extra=1),  # an OrderedDict with more than a state dict's attribute
        collections.defaultdict(list, w=torch.zeros(1)),  # another dict class
        {"w": torch.zeros(1), "step": 3},  # a leaf that is not a tensor
        [torch.zeros(1), torch.zeros(1)],
    ],
)
def test_any_other_skeleton_travels_pickled_beside_the_record(value):
    skeleton, tensors = flatten(value)
    obj = _obj(specs=tuple(TensorSpec.of(t) for t in tensors), skeleton=skeleton, meta={})
    rebuild, args = obj.__reduce_ex__(5)
    assert rebuild is _object._rebuilt and args[1] is skeleton
    back = pickle.loads(pickle.dumps(obj, protocol=5))
    assert type(back.skeleton) is type(skeleton) and repr(back.skeleton) == repr(skeleton)

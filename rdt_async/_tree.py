"""Flatten values holding tensors into (skeleton, tensors) and back."""

from __future__ import annotations

import copy
import dataclasses
import enum
import io
import pickle
from typing import Any

import torch

from ._errors import TransferError


class Slot:
    """Stands in the skeleton where tensor number `index` was."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return (Slot, (self.index,))

    def __repr__(self) -> str:
        return f"<tensor {self.index}>"


class Packed:
    """Stands in the skeleton for a leaf of another type that holds tensors (a TensorDict,
    a user's class): its pickle, with each tensor left out and named by its place in
    `slots` (`pickle`'s persistent ids), as Ray's own RDT takes the tensors out of a
    value it pickles."""

    __slots__ = ("data", "kind", "slots")

    def __init__(self, data: bytes, slots: tuple[int, ...], kind: str) -> None:
        self.data = data
        self.slots = slots
        self.kind = kind  # the leaf's type, for reprs and errors

    def __reduce__(self) -> tuple[Any, ...]:
        return (Packed, (self.data, self.slots, self.kind))

    def __repr__(self) -> str:
        return f"<{self.kind} of {len(self.slots)} tensor(s)>"


def flatten(value: Any, *, tied: bool = False) -> tuple[Any, list[torch.Tensor]]:
    """Return the value with every tensor replaced by a `Slot`, and the tensors in order.

    Walks dict, list, tuple, namedtuple and dataclass instances. A leaf of any other type
    that holds tensors (a TensorDict, a set, a user's class) is pickled with its tensors
    left out (`Packed`); other leaves stay as they are. `tied`: a tensor that is another
    one under a second name (the same memory, dtype, shape and strides: tied weights, as
    `model.state_dict()` of a model with tied embeddings gives) takes that one's slot, so
    that it is moved once and arrives as one tensor under both names.
    Raises: TypeError naming the leaf's type where a leaf cannot be pickled here (so
    its tensors, if any, cannot be taken out).
    """
    tensors: list[torch.Tensor] = []
    return _Flatten(tensors, _Ties() if tied else None).walk(value), tensors


def slot_order(skeleton: Any) -> list[int]:
    """The tensor index of each of the skeleton's tensors, in `flatten`'s order (an index
    appears twice where the value held one tensor under two names)."""
    order: list[int] = []
    _Order(order).walk(skeleton)
    return order


def firsts(tensors: list[torch.Tensor]) -> list[int]:
    """For each tensor, the index of the first that is the same tensor (`same_tensor`): its
    own, or an earlier one's where it is that one under another name (tied weights)."""
    ties = _Ties()
    return [i if (j := ties.earlier(t, tensors, i)) is None else j for i, t in enumerate(tensors)]


class _Ties:
    """The tensors seen so far, by the address of their first byte: which earlier one a
    tensor is under another name (`same_tensor`), found by one int a tensor, the full
    comparison only where two addresses meet."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at: dict[int, list[int]] = {}

    def earlier(self, t: torch.Tensor, tensors: list[torch.Tensor], index: int) -> int | None:
        """The index in `tensors` of the one `t` is, or None (`t` noted as `index`)."""
        at = address(t)
        if not at:
            return None
        seen = self.at.setdefault(at, [])
        for i in seen:
            if same_tensor(t, tensors[i]):
                return i
        seen.append(index)
        return None


def address(t: torch.Tensor) -> int:
    """Where `t`'s first byte lies; 0 where it has none that can be asked for (no elements,
    no storage: sparse, meta, a wrapper subclass). Such a tensor is no one's second name."""
    try:
        return t.data_ptr() if t.numel() else 0
    except (RuntimeError, NotImplementedError):
        return 0


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are one tensor under two names: the same memory, read alike (two
    without bytes, or without plain ones, never are)."""
    return (
        address(a) == address(b) != 0 and a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
        and a.stride() == b.stride() and a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg()
    )


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuild a value from its skeleton and tensors."""
    return _Unflatten(tensors).walk(skeleton)


# Walkers are objects, not closures: a recursive closure is a reference cycle that
# would keep the tensors alive until the cyclic GC runs, delaying frees.
class _Flatten:
    __slots__ = ("tensors", "ties")

    def __init__(self, tensors: list[torch.Tensor], ties: _Ties | None) -> None:
        self.tensors = tensors
        self.ties = ties  # with `tied`

    def walk(self, v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if self.ties is not None and (type(v) is torch.Tensor or type(v) is torch.nn.Parameter):
                i = self.ties.earlier(v, self.tensors, len(self.tensors))
                if i is not None:
                    return Slot(i)
            self.tensors.append(v)
            return Slot(len(self.tensors) - 1)
        if type(v) in _ATOMS:
            return v
        out = _map_children(v, self.walk, _LEAF)
        return self.pack(v) if out is _LEAF else out

    def pack(self, v: Any) -> Any:
        """`v` itself where it holds no tensor, else its `Packed` form."""
        if _holds_none(v):
            return v
        packed = _pickle_out(v)
        if packed is None:
            return v  # (pickled again by Ray, as before: leaves of other types are rare)
        data, inside = packed
        start = len(self.tensors)
        self.tensors.extend(inside)
        return Packed(data, tuple(range(start, len(self.tensors))), type(v).__qualname__)


class _Order:
    """`slot_order`'s walker: the index of each `Slot` met, a `Packed` leaf's in its order."""

    __slots__ = ("order",)

    def __init__(self, order: list[int]) -> None:
        self.order = order

    def walk(self, v: Any) -> Any:
        if isinstance(v, Slot):
            self.order.append(v.index)
        elif isinstance(v, Packed):
            self.order.extend(v.slots)
        else:
            _map_children(v, self.walk, v)
        return v


class _Unflatten:
    __slots__ = ("tensors",)

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def walk(self, v: Any) -> Any:
        if isinstance(v, Slot):
            i = v.index
            if type(i) is not int or not 0 <= i < len(self.tensors):  # (a skeleton from another process)
                raise TransferError(f"the value's skeleton names tensor {i!r} of {len(self.tensors)}")
            return self.tensors[i]
        if isinstance(v, Packed):
            return _unpack(v, self.tensors)
        return _map_children(v, self.walk, v)


def path(value: Any, k: int) -> str:
    """Where tensor `k` of `value` (in flatten's order) lies in it, as code would reach it:
    `['layer1.weight']`, `[0].bias`; "" for the value itself or one it cannot name (a
    tensor inside a leaf of another type). For messages: it walks the value."""
    left = [k]

    def find(v: Any, at: str) -> str | None:
        if isinstance(v, torch.Tensor):
            left[0] -= 1
            return at if left[0] < 0 else None
        if type(v) in _ATOMS:
            return None
        children = _named_children(v)
        for key, x in children:
            found = find(x, at + key)
            if found is not None:
                return found
        if children or _holds_none(v):
            return None
        inside = _pickle_out(v)  # a leaf of another type: its tensors, unnamed
        left[0] -= 0 if inside is None else len(inside[1])
        return at if left[0] < 0 else None

    return find(value, "") or ""


def names(value: Any) -> list[str] | None:
    """Where each tensor of `value` (or each `Slot` of a skeleton) lies in it, in flatten's
    order, as `path` names it; None where one lies inside a leaf of another type (unnamed)."""
    out: list[str] = []

    def walk(v: Any, at: str) -> bool:
        if isinstance(v, (torch.Tensor, Slot)):
            out.append(at)
            return True
        if type(v) in _ATOMS:
            return True
        children = _named_children(v)
        if not children:
            return isinstance(v, (dict, list, tuple)) or _holds_none(v)  # (an empty container: nothing in it)
        return all(walk(x, at + key) for key, x in children)

    return out if walk(value, "") else None


def _named_children(v: Any) -> list[tuple[str, Any]]:
    """`_map_children`'s children of `v`, in its order, each with how code reaches it."""
    if isinstance(v, dict):
        return [(f"[{k!r}]", x) for k, x in v.items()]
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        return [(f".{f}", x) for f, x in zip(v._fields, v)]
    if type(v) is tuple or isinstance(v, list):  # (another tuple subclass is a leaf there)
        return [(f"[{i}]", x) for i, x in enumerate(v)]
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return [(f".{f.name}", getattr(v, f.name)) for f in dataclasses.fields(v)]
    return []


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Return the tensors of a value, in flatten order."""
    return flatten(value)[1]


_LEAF: Any = object()  # what `_map_children` returns for a leaf, when asked to
# Leaves that cannot hold a tensor, skipped without a look (the common ones).
_ATOMS = frozenset(
    {int, float, bool, str, bytes, complex, type(None), type(...), range, slice, torch.dtype, torch.device, torch.Size}
)


def _holds_none(v: Any) -> bool:
    """Say whether leaf `v` surely holds no tensor (no pickling needed to tell)."""
    t = type(v)
    if isinstance(v, (enum.Enum, type)):
        return True
    if (t.__module__ or "").split(".")[0] in ("ray", "rdt_async"):
        return True  # refs, handles, RDTObjects: no tensors, and pickled by Ray's own means
    if t.__module__ == "numpy" and t.__name__ == "ndarray":
        return not v.dtype.hasobject
    return False


class _Out:
    """A pickler's `persistent_id`: takes each tensor out, once however often it appears."""

    __slots__ = ("places", "tensors")

    def __init__(self) -> None:
        self.places: dict[int, int] = {}  # id(tensor) -> its place in `tensors`
        self.tensors: list[torch.Tensor] = []

    def __call__(self, obj: Any) -> int | None:
        if not isinstance(obj, torch.Tensor):
            return None
        place = self.places.get(id(obj))
        if place is None:
            place = self.places[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return place


def _pickle_out(v: Any) -> tuple[bytes, list[torch.Tensor]] | None:
    """Pickle `v` with its tensors left out, as Ray would (its cloudpickle where plain
    pickle cannot); None where it holds no tensor, or neither can pickle it (Ray's own
    serializers may know its type).

    Raises: TypeError naming the type of `v` and the fix where it holds tensors and
    cannot be pickled (Ray would send them inside the value, or fail).
    """
    for cloud in (False, True):
        out, taken = io.BytesIO(), _Out()
        if cloud:
            from ray import cloudpickle  # lambdas, local classes: as Ray itself pickles them

            pickler: pickle.Pickler = cloudpickle.CloudPickler(out, protocol=5)
        else:
            pickler = pickle.Pickler(out, protocol=5)
        pickler.persistent_id = taken  # type: ignore[method-assign]
        try:
            pickler.dump(v)
        except Exception as exc:
            if taken.tensors:
                raise TypeError(
                    f"the value holds a {type(v).__qualname__} with tensors that cannot be pickled ({exc}), "
                    "so rdt_async cannot take its tensors out: return them in a dict, list, tuple, named "
                    "tuple or dataclass instead"
                ) from exc
            continue
        return (out.getvalue(), taken.tensors) if taken.tensors else None
    return None


def _unpack(p: Packed, tensors: list[torch.Tensor]) -> Any:
    """Rebuild a `Packed` leaf around `tensors` (the whole value's).

    Raises: TransferError where its places are not those of `tensors` (it came from
    another process).
    """
    slots = p.slots
    if type(slots) is not tuple or not all(type(i) is int and 0 <= i < len(tensors) for i in slots):
        raise TransferError(f"the value's skeleton names tensors {slots!r} of {len(tensors)}")

    def persistent_load(pid: Any) -> torch.Tensor:
        if type(pid) is not int or not 0 <= pid < len(slots):
            raise TransferError(f"the value's {p.kind} names tensor {pid!r} of {len(slots)}")
        return tensors[slots[pid]]

    unpickler = pickle.Unpickler(io.BytesIO(p.data))
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    return unpickler.load()


def _map_children(v: Any, fn: Any, leaf: Any) -> Any:
    t = type(v)
    if t is dict:
        return {k: fn(x) for k, x in v.items()}
    if t is list:
        return [fn(x) for x in v]
    if t is tuple:
        return tuple(fn(x) for x in v)
    if isinstance(v, tuple) and hasattr(v, "_fields"):  # namedtuple
        return t(*(fn(x) for x in v))
    if isinstance(v, dict):  # OrderedDict, defaultdict and other dict subclasses: the same class
        mapping = copy.copy(v)  # (with its attributes; no __init__ called)
        for k, x in v.items():
            mapping[k] = fn(x)
        return mapping
    if isinstance(v, list):  # list subclasses, whatever their __init__ takes
        items = copy.copy(v)
        items[:] = [fn(x) for x in v]
        return items
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        out = object.__new__(t)
        if hasattr(v, "__dict__"):
            for k, x in vars(v).items():
                object.__setattr__(out, k, x)
        for f in dataclasses.fields(v):
            object.__setattr__(out, f.name, fn(getattr(v, f.name)))
        return out
    return leaf

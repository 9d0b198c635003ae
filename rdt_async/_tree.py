"""Flatten values holding tensors into (skeleton, tensors) and back."""

from __future__ import annotations

import copy
import dataclasses
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


def flatten(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """Return the value with every tensor replaced by a `Slot`, and the tensors in order.

    Walks dict, list, tuple, namedtuple and dataclass instances; anything else is a leaf.
    """
    tensors: list[torch.Tensor] = []
    return _Flatten(tensors).walk(value), tensors


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuild a value from its skeleton and tensors."""
    return _Unflatten(tensors).walk(skeleton)


# Walkers are objects, not closures: a recursive closure is a reference cycle that
# would keep the tensors alive until the cyclic GC runs, delaying frees.
class _Flatten:
    __slots__ = ("tensors",)

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def walk(self, v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            self.tensors.append(v)
            return Slot(len(self.tensors) - 1)
        return _map_children(v, self.walk)


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
        return _map_children(v, self.walk)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Return the tensors of a value, in flatten order."""
    return flatten(value)[1]


def _map_children(v: Any, fn: Any) -> Any:
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
    return v

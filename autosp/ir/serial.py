"""Graphs to bytes and back (pickle), for passing a trace between processes: `autosp plan`'s two
probe processes each trace one length and hand it to the other.

    data = dumps(graph)
    again = loads(data)        # prints the same; each Op is the canonical one of its target

An Op's target (an OpOverload) does not pickle: it goes by name (namespace, op, overload) and is
looked up again, so the process that loads must have the same operators registered (autosp's own
are, on import).
"""
from __future__ import annotations

import io
import pickle
import warnings

import torch

from autosp.ir.ops import Op, op_for


def _overload(namespace: str, name: str, overload: str):
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _op(name: str, target, tags: frozenset) -> Op:
    op = op_for(target) if target is not None else None
    return op if op is not None and op.name == name and op.tags == tags else Op(name, target, tags)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return _overload, (obj.namespace, obj._schema.name.split("::")[1], obj._overloadname)
        if isinstance(obj, Op):
            return _op, (obj.name, obj.target, obj.tags)
        return NotImplemented


def dumps(obj) -> bytes:
    """`obj` (a Graph, or anything holding Graphs) as bytes."""
    f = io.BytesIO()
    _Pickler(f, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return f.getvalue()


def loads(data: bytes):
    with warnings.catch_warnings():          # torch warns of the tree specs' classes it unpickles
        warnings.simplefilter("ignore", FutureWarning)
        return pickle.loads(data)

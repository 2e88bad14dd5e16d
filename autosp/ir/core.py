"""The IR's records: Var, Eqn, Graph. Plain frozen data; passes build new graphs.

A `Graph` is a flat list of equations over SSA variables, in the spirit of a
jaxpr. Tensor-valued arguments of an equation are `Var`s; every other argument
(ints, lists of ints, dtypes, devices) is kept verbatim in the equation's
argument template, where `In(k)` marks the k-th tensor input.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autosp.ir.ops import Op


class Role(enum.Enum):
    INPUT = "input"        # a graph input the caller passes (batch values)
    PARAM = "param"        # a graph input that is differentiated (requires_grad)
    FROZEN = "frozen"      # a graph input that is a parameter not differentiated (an nn.Parameter without
                           # requires_grad: LoRA's base): no gradient, and, like a PARAM, not the batch
    CONST = "const"        # a tensor captured from the function's closure (buffers)
    TANGENT = "tangent"    # a joint graph's input: the gradient seed of a forward output
    VALUE = "value"        # produced by an equation


@dataclass(frozen=True, slots=True)
class Var:
    name: str
    dtype: torch.dtype | None          # None: not a tensor (a None output slot)
    shape: tuple[int, ...]
    device: str = "cpu"
    layout: Any = None                 # autosp.layout.Layout once sharded, else None
    role: Role = Role.VALUE

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def nbytes(self) -> int:
        """Bytes of the value's elements (0 for a non-tensor value)."""
        return 0 if self.dtype is None else self.numel() * self.dtype.itemsize

    def type_str(self) -> str:
        if self.dtype is None:
            return "none"
        dims = self.layout.format(self.shape) if self.layout is not None else ",".join(map(str, self.shape))
        return f"{dtype_short(self.dtype)}[{dims}]"

    def __str__(self) -> str:
        return f"%{self.name}"


@dataclass(frozen=True, slots=True)
class In:
    """Placeholder for the k-th tensor input inside an equation's argument template."""
    k: int

    def __repr__(self) -> str:
        return f"In({self.k})"


@dataclass(frozen=True, slots=True)
class Eqn:
    op: Op
    inputs: tuple[Var, ...]
    outputs: tuple[Var, ...]
    args: tuple                          # template: In(k) where inputs[k] goes
    kwargs: tuple[tuple[str, Any], ...]
    multi: bool = False                  # the op returns a tuple/list (outputs map to its items)
    source: str | None = None            # the user's source line, from fx's stack trace

    @staticmethod
    def make(op: Op, args, kwargs, outputs, *, multi=False, source=None) -> "Eqn":
        """Build an equation from args/kwargs that hold Vars where tensors go."""
        inputs: list[Var] = []

        def hole(x):
            if isinstance(x, Var):
                inputs.append(x)
                return In(len(inputs) - 1)
            return x

        targs = map_args(hole, tuple(args))
        tkw = map_args(hole, dict(kwargs))
        return Eqn(op, tuple(inputs), tuple(outputs), _freeze(targs), tuple(tkw.items()), multi, source)

    def bind(self, values) -> tuple[tuple, dict]:
        """(args, kwargs) with In(k) replaced by values[k]."""
        fill = lambda x: values[x.k] if isinstance(x, In) else x
        return map_args(fill, self.args), {k: map_args(fill, v) for k, v in self.kwargs}

    def var_args(self) -> tuple[tuple, dict]:
        """(args, kwargs) with the input Vars in place: what rules and the printer read."""
        return self.bind(self.inputs)

    def bind_schema(self, values=None) -> dict:
        """Argument name -> value (Vars where tensors go, or `values`), defaults filled in, from the
        op's schema."""
        args, kwargs = self.bind(values if values is not None else self.inputs)
        out = {}
        for i, a in enumerate(self.op.target._schema.arguments):
            if i < len(args):
                out[a.name] = args[i]
            elif a.name in kwargs:
                out[a.name] = kwargs[a.name]
            else:
                out[a.name] = a.default_value if a.has_default_value() else None
        return out

    def replace(self, **changes) -> "Eqn":
        return dataclasses.replace(self, **changes)

    def format(self) -> str:
        args, kwargs = self.var_args()
        parts = [_fmt_arg(a) for a in args] + [f"{k}={_fmt_arg(v)}" for k, v in kwargs.items()]
        outs = ", ".join(f"{v}: {v.type_str()}" for v in self.outputs) or "_"
        return f"{outs} = {self.op.name}({', '.join(parts)})"


class PerEqn:
    """A value derived from each equation, kept by the equation's identity (equations are immutable, and the planner
    simulates and schedules many programs made of the same ones); forgotten all at once past `limit` entries.
    `get(e, make, *extra)`: make(e, *extra), once per (e, *extra)."""

    def __init__(self, limit: int = 200_000):
        self._kept: dict = {}
        self._limit = limit

    def get(self, e: Eqn, make, *extra):
        key = (id(e), *extra) if extra else id(e)
        hit = self._kept.get(key)
        if hit is None or hit[0] is not e:
            if len(self._kept) > self._limit:
                self._kept.clear()
            hit = self._kept[key] = (e, make(e, *extra))
        return hit[1]


@dataclass(frozen=True, slots=True)
class Graph:
    inputs: tuple[Var, ...]
    eqns: tuple[Eqn, ...]
    outputs: tuple[Any, ...]             # Vars, or Python literals the function returns as is
    in_spec: pytree.TreeSpec | None = None
    out_spec: pytree.TreeSpec | None = None
    consts: tuple[tuple[Var, torch.Tensor], ...] = ()
    static_args: tuple[tuple[int, Any], ...] = ()   # flat positions of non-tensor leaves, baked in
    name: str = "trace"                  # the pass that produced this graph

    def replace(self, **changes) -> "Graph":
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        lines = [f"# {self.name}"]
        ins = ", ".join(f"{v}: {v.type_str()}" for v in self.inputs)
        lines.append(f"graph({ins}):")
        for v, t in self.consts:
            lines.append(f"  {v}: {v.type_str()} = const")
        for e in self.eqns:
            lines.append("  " + e.format())
        lines.append("  return " + ", ".join(_fmt_arg(o) for o in self.outputs))
        return "\n".join(lines)

    def __call__(self, *args):
        from autosp.ir.interpret import call_graph
        return call_graph(self, *args)

    def index(self) -> tuple[dict[str, int], dict[str, list[int]], set[str]]:
        """(var -> index of the equation producing it, var -> indices of the equations reading it,
        names of the graph's outputs): what pattern finders walk."""
        producer = {o.name: k for k, e in enumerate(self.eqns) for o in e.outputs}
        readers: dict[str, list[int]] = {}
        for k, e in enumerate(self.eqns):
            for x in e.inputs:
                readers.setdefault(x.name, []).append(k)
        return producer, readers, {o.name for o in self.outputs if hasattr(o, "name")}


_DTYPE_SHORT = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64",
}


def dtype_short(dtype: torch.dtype) -> str:
    return _DTYPE_SHORT.get(dtype, str(dtype).removeprefix("torch."))


def _fmt_arg(a) -> str:
    if isinstance(a, Var):
        return str(a)
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt_arg(x) for x in a)
        return f"[{inner}]"
    if isinstance(a, torch.dtype):
        return dtype_short(a)
    if isinstance(a, float):
        return repr(a)
    return repr(a) if isinstance(a, str) else str(a)


def map_args(f, x):
    """f over the leaves of an op's argument: its lists, tuples and dicts (fx's immutable ones, torch.Size) rebuilt
    as plain ones around f of everything else. torch's pytree.tree_map for what aten's arguments are made of, at
    a tenth of its cost (every equation a pass makes or reads goes through it)."""
    if isinstance(x, list):
        return [map_args(f, y) for y in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(map_args(f, y) for y in x)
    if isinstance(x, dict):
        return {k: map_args(f, y) for k, y in x.items()}
    return f(x)


def _freeze(x):
    """Lists become tuples so that equations are immutable all the way down (aten takes both)."""
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    if isinstance(x, dict):
        return {k: _freeze(v) for k, v in x.items()}
    return x

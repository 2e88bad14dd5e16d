"""A joint program at another sequence length, without differentiating it again.

    joint_b = rescale(joint_a, step_a, step_b)   # step_b: the forward step_a traced at another length

Differentiating (make_fx over the forward and torch.autograd.grad) is the slow part of planning: 7 s
for an 8B Llama's step whole, 12-16 s with its position-wise chains tiled (1 and 4 s one distinct segment
at a time, passes/segments.py), and `autosp plan` needs every program at several lengths. But two traces of one step at two lengths are one program whose sizes differ
(the planner's affine model rests on it), and so are their backwards. So the joint is traced once and
re-instantiated: every size that moves between the two forwards (L, L / P, a tile's L / Pk, ...) is
moved in the joint's shapes and arguments, and each equation is run on fake tensors at the new sizes,
which gives its outputs' shapes and checks that it accepts its arguments.

It is exact or it refuses (`RescaleError`; the caller differentiates instead): an int means one thing
everywhere. A size that moves must never also appear where it stays (hidden 4096 = L / P 4096 at one
length), no argument the joint reads unmoved may later turn out to move, and the joint's outputs must
come out with the forward's outputs' and the parameters' shapes. What shapes cannot show is refused
outright: an int new to the forwards that is a multiple of a size that moves (a mean's element count),
a float that is such a size or its inverse, and constants the joint's trace made itself. A slice's
start and end that are multiples of a size that moves (a tile's offset) move with it. The tests hold
rescaled joints equal, equation for equation, to joints differentiated at the other length, and run a
step compiled from a rescaled joint against the single device.

Only the backward is re-instantiated: the forward traces at both lengths are what the size map is read
from. A forward alone cannot tell its sizes apart (shard_slice's chunk L / P first appears as an
argument; a layout's valid length L - 1 appears in no shape).
"""
from __future__ import annotations

import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from autosp.errors import AutospError
from autosp.ir.core import Graph, In, Var, map_args


class RescaleError(AutospError):
    """The two forwards are not one program at two lengths, or a size is ambiguous."""


class Sizes:
    """Which ints move between two instances of one program, and which stay (each int one meaning)."""

    def __init__(self):
        self.moved: dict[int, int] = {}
        self.kept: set[int] = set()
        self.known: set[int] | None = None      # the ints the forwards showed (set by freeze())

    def freeze(self) -> None:
        """From here on an int neither forward showed must not be a product of a size that moves (a
        mean's element count, L / P x 4096, would stay where it should move: a wrong value, not a wrong
        shape)."""
        self.known = set(self.moved) | set(self.kept)

    def _product(self, n: int) -> bool:
        n = abs(n)
        return n > 0 and any(u > 1 and n != u and n % u == 0 for u in self.moved)

    def pair(self, x: int, y: int, where) -> None:
        if x == y:
            if x in self.moved:
                raise RescaleError(f"rescale: {x} both moves (to {self.moved[x]}) and stays ({where()})")
            self.kept.add(x)
        elif x in self.kept or self.moved.setdefault(x, y) != y:
            other = "stays" if x in self.kept else f"to {self.moved[x]}"
            raise RescaleError(f"rescale: {x} moves to {y} and {other} ({where()})")

    def shapes(self, a: tuple, b: tuple, where) -> None:
        if len(a) != len(b):
            raise RescaleError(f"rescale: rank differs, {list(a)} vs {list(b)} ({where()})")
        for x, y in zip(a, b):
            self.pair(x, y, where)

    def move(self, x):
        """An argument at the other length: ints (not bools) that move are moved; the others are
        recorded as staying, so that a later output cannot make them move. Refused: a float that is a
        size that moves or its inverse (a count as a scale), and an int new to the forwards that is a
        multiple of a size that moves."""
        if isinstance(x, float) and x not in (0.0, float("inf"), float("-inf")) and x == x:
            n = abs(x) if abs(x) >= 1 else 1 / abs(x)
            if abs(n - round(n)) <= 1e-9 * n and (round(n) in self.moved or self._product(round(n))):
                raise RescaleError(f"rescale: the float {x} is a size that moves, a multiple or an inverse of "
                                   "one; whether it moves cannot be told")
        if isinstance(x, bool) or not isinstance(x, int):
            return x
        if x in self.moved:
            return self.moved[x]
        if self.known is not None and x not in self.known and self._product(x):
            raise RescaleError(f"rescale: {x} is a multiple of a size that moves and new to the forward traces; "
                               "whether it moves cannot be told")
        self.kept.add(x)
        return x

    def position(self, p):
        """A position along a dimension (a slice's start or end): a multiple of a size that moves (a tile's
        offset, j tiles in) moves with it; a constant offset (a label shift's 1) stays."""
        if isinstance(p, bool) or not isinstance(p, int) or p in self.kept or abs(p) >= 2**62:
            return self.move(p)
        if p in self.moved:
            return self.moved[p]
        found = {p // u * v for u, v in self.moved.items() if u > 1 and p % u == 0}
        if len(found) > 1:
            raise RescaleError(f"rescale: the position {p} is a multiple of sizes that move differently "
                               f"(to {sorted(found)})")
        if found:
            self.moved[p] = found.pop()
        return self.move(p)


# ops whose position arguments move in proportion to the sizes they are multiples of
aten = torch.ops.aten
_POSITIONS = {aten.slice.Tensor: ("start", "end"), aten.slice_backward.default: ("start", "end"),
              aten.narrow.default: ("start", "length"), aten.slice_scatter.default: ("start", "end")}


def _map(f, x):
    """f over the leaves of an op's argument (an In stays)."""
    return map_args(lambda y: y if isinstance(y, In) else f(y), x)


def _move_args(e, sizes: Sizes):
    """The equation's (args, kwargs) at the other length."""
    names = _POSITIONS.get(e.op.target, ())
    schema = [a.name for a in e.op.target._schema.arguments] if names else []
    args = tuple(sizes.position(x) if i < len(schema) and schema[i] in names
                 else _map(sizes.move, x) for i, x in enumerate(e.args))
    kwargs = tuple((k, sizes.position(x) if k in names else _map(sizes.move, x)) for k, x in e.kwargs)
    return args, kwargs


def _same(a, b) -> bool:
    """The same leaves (moving returns an argument that stays as itself)."""
    if type(a) in (list, tuple):
        return type(b) is type(a) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a is b


def _ints(tree) -> list:
    leaves = pytree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, In))
    return [x for x in leaves if isinstance(x, (int, float)) and not isinstance(x, bool)]


def size_map(a: Graph, b: Graph) -> Sizes:
    """The sizes of two traces of one forward: what moves (a's int -> b's) and what stays. Refused
    unless both are the same program (ops, argument structure, ranks) with every int one meaning."""
    sizes = Sizes()
    if len(a.inputs) != len(b.inputs) or len(a.eqns) != len(b.eqns) or len(a.consts) != len(b.consts):
        raise RescaleError(f"rescale: {a.name} and {b.name} are different programs "
                           f"({len(a.eqns)} and {len(b.eqns)} equations)")
    for va, vb in zip((*a.inputs, *(v for v, _ in a.consts)), (*b.inputs, *(v for v, _ in b.consts))):
        sizes.shapes(va.shape, vb.shape, lambda: f"input {va}")
    for k, (ea, eb) in enumerate(zip(a.eqns, b.eqns)):
        where = lambda: f"equation {k}, {ea.format()}"      # noqa: E731 - formatted only on failure
        if ea.op.name != eb.op.name or len(ea.outputs) != len(eb.outputs):
            raise RescaleError(f"rescale: equation {k} is {ea.op.name} in one trace, {eb.op.name} in the other")
        for oa, ob in zip(ea.outputs, eb.outputs):
            sizes.shapes(oa.shape, ob.shape, where)
        xa, xb = _ints((ea.args, ea.kwargs)), _ints((eb.args, eb.kwargs))
        if len(xa) != len(xb):
            raise RescaleError(f"rescale: the arguments of equation {k} differ in structure ({where()})")
        for x, y in zip(xa, xb):
            if isinstance(x, float) or isinstance(y, float):
                if x != y:
                    raise RescaleError(f"rescale: a float argument moves, {x} -> {y} ({where()})")
                continue
            sizes.pair(x, y, where)
    return sizes


def reinstantiate(g: Graph, sizes: Sizes, consts) -> Graph:
    """`g` with the sizes that move moved: its inputs' shapes moved, every equation run on fake tensors at
    the new sizes (its arguments moved, its outputs' shapes taken from the run, each checked against
    `sizes`). `consts`: the first constants' tensors at the new sizes (the rest must not move)."""
    env: dict[str, torch.Tensor] = {}
    new: dict[str, Var] = {}

    def at(v: Var, shape) -> Var:
        sizes.shapes(v.shape, tuple(shape), lambda: f"value {v}")
        out = v if tuple(shape) == v.shape else dataclasses.replace(v, shape=tuple(shape))
        new[v.name] = out
        return out

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    new_consts = []
    ran: dict = {}      # an equation's signature -> its outputs: a model's layers repeat (32 alike at 8B)
    with mode:
        inputs = []
        for v in g.inputs:
            shape = tuple(sizes.move(d) for d in v.shape)
            env[v.name] = torch.empty(shape, dtype=v.dtype, device=v.device)
            inputs.append(at(v, shape))
        for k, (v, t) in enumerate(g.consts):
            t = consts[k] if k < len(consts) else t
            env[v.name] = torch.empty(t.shape, dtype=v.dtype, device=v.device)
            new_consts.append((at(v, t.shape), t))

        def value(x: Var):
            t = env.get(x.name)
            if t is None:                       # made by an equation that did not run: a stand-in
                v = new[x.name]
                t = env[x.name] = torch.empty(v.shape, dtype=v.dtype, device=v.device)
            return t

        eqns = []
        for k, e in enumerate(g.eqns):
            args, kwargs = _move_args(e, sizes)
            if (_same((args, kwargs), (e.args, e.kwargs)) and all(new[x.name] is x for x in e.inputs)
                    and all(v.dtype is not None for v in e.outputs)):
                # nothing it reads moved: its outputs are as traced (shapes are functions of the inputs'
                # shapes and the arguments), so it need not run; the sizes it shows stay
                eqns.append(e.replace(outputs=tuple(at(v, v.shape) for v in e.outputs)))
                continue
            moved = e.replace(args=args, kwargs=kwargs)
            ins = [value(x) for x in e.inputs]
            key = _signature(e, args, kwargs, ins)
            out = ran.get(key) if key is not None else None
            if out is None:
                bound_args, bound_kwargs = moved.bind(ins)
                try:
                    out = e.op.target(*bound_args, **bound_kwargs)
                except Exception as exc:  # noqa: BLE001 - any failure means: trace instead
                    raise RescaleError(f"rescale: equation {k} fails at the other length, {e.format()}: "
                                       f"{type(exc).__name__}: {str(exc)[:200]}") from None
                if key is not None:
                    ran[key] = out
            outs = list(out) if e.multi else [out] if e.outputs else []
            vars_out = []
            for v, x in zip(e.outputs, outs):
                if isinstance(x, torch.Tensor):
                    if x.dtype != v.dtype:
                        raise RescaleError(f"rescale: equation {k} gives {x.dtype}, traced {v.dtype}")
                    vars_out.append(at(v, x.shape))
                else:
                    vars_out.append(v)
                env[v.name] = x
            eqns.append(moved.replace(inputs=tuple(new[x.name] for x in e.inputs), outputs=tuple(vars_out)))
    outputs = tuple(new[o.name] if isinstance(o, Var) else o for o in g.outputs)
    return g.replace(inputs=tuple(inputs), eqns=tuple(eqns), outputs=outputs, consts=tuple(new_consts))


def _signature(e, args, kwargs, ins):
    """What an equation's outputs' metadata is a function of: its op, its arguments (each leaf with its type: 1,
    1.0 and True differ) and its inputs' sizes, strides and dtypes, and their offsets where an output is a view of
    an input (a new tensor starts at 0 whatever its inputs' offsets: a tiled loss's tiles, slices of one tensor,
    share their nll_loss). None: not to be shared (an op that writes its inputs, or an argument that is not
    hashable), so it runs."""
    schema = e.op.target._schema
    if schema.is_mutable:
        return None
    views = any(r.alias_info is not None for r in schema.returns)

    def frozen(x):
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, tuple(frozen(y) for y in x))
        return (type(x), x)
    try:
        key = (e.op.target, frozen(args), frozen(kwargs),
               tuple((t.shape, t.stride(), views and t.storage_offset(), t.dtype, t.device)
                     if isinstance(t, torch.Tensor) else (type(t), t) for t in ins))
        hash(key)
    except TypeError:
        return None
    return key


def rescale(joint, step_a: Graph, step_b: Graph):
    """`joint` (autodiff.Joint, the differentiation of `step_a`) as the differentiation of `step_b`,
    the same forward traced at another length. Raises RescaleError where that cannot be shown."""
    from autosp.passes.autodiff import Joint
    sizes = size_map(step_a, step_b)
    sizes.freeze()
    if len(joint.graph.consts) > len(step_a.consts):
        raise RescaleError("rescale: the joint holds constants its trace made, whose values may depend on the "
                           "length where their shapes do not")
    g = reinstantiate(joint.graph, sizes, [t for _, t in step_b.consts])
    # the forward's outputs are step_b's, the gradients their parameters' shapes
    for o, want in zip(g.outputs, step_b.outputs):
        if isinstance(o, Var) and o.shape != want.shape:
            raise RescaleError(f"rescale: forward output {o} comes out {list(o.shape)}, traced {list(want.shape)}")
    for o, i in zip(g.outputs[joint.n_fwd_outputs:], joint.diff_inputs):
        if isinstance(o, Var) and o.shape != g.inputs[i].shape:
            raise RescaleError(f"rescale: the gradient {o} of input {i} is {list(o.shape)}, the input "
                               f"{list(g.inputs[i].shape)}")
    graph = g.replace(in_spec=step_b.in_spec, static_args=step_b.static_args, name="rescale")
    return Joint(graph, joint.n_primals, joint.n_fwd_outputs, joint.boundary, joint.diff_inputs, joint.diff_outputs)


def extrapolate(a: Graph, la: int, b: Graph, lb: int, length: int) -> Graph:
    """The forward traced at lengths `la` and `lb` (`a`, `b`), at a third `length`, without tracing it: every
    size that moves between the two (L, L / P, L - 1, a tile's L / Pk) is affine in the length, so it is moved to
    its value on the line through the two, and `a` is re-instantiated there (each equation run on fake tensors,
    its outputs' shapes checked against the moved sizes as rescale checks them). Refused (RescaleError; trace
    instead) where a moved size is not a positive int at `length`, where a constant's shape moves, or where any
    equation's shapes disagree with the line (a size that grows otherwise than in proportion: L x L)."""
    found = size_map(a, b)
    sizes = Sizes()
    sizes.kept = set(found.kept)
    for x, y in found.moved.items():
        step = (y - x) * (length - la)
        if step % (lb - la) or x + step // (lb - la) <= 0:
            raise RescaleError(f"rescale: the size {x} at {la:,} ({y} at {lb:,}) is no positive int at {length:,}")
        sizes.moved[x] = x + step // (lb - la)
    sizes.freeze()
    for v, _ in a.consts:
        if any(d in sizes.moved for d in v.shape):
            raise RescaleError(f"rescale: the constant {v} {list(v.shape)} moves with the length: trace it")
    g = reinstantiate(a, sizes, [])
    for o, want in zip(g.outputs, a.outputs):
        if isinstance(o, Var) and o.shape != tuple(sizes.move(d) for d in want.shape):
            raise RescaleError(f"rescale: output {o} comes out {list(o.shape)} at {length:,}")
    return g


def program_key(printed: str) -> str:
    """What two traces of one program at two lengths share: the printed graph (str(graph)) without its
    numbers."""
    import re
    return re.sub(r"\d+", "", printed)


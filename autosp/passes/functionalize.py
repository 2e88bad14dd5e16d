"""Functionalize: in-place ops become their out-of-place twins (Graph -> Graph).

A pre-dispatch trace keeps mutations (`x += y`, `z[..., :2] = q`, `masked_fill_`) so that
`aten.linear` and SDPA survive; the sharding rules are written for values, not for memory.
Each in-place equation becomes the functional op (`add_` -> `add`, `copy_` -> `copy`,
`fill_` -> `fill`, `index_put_` -> `index_put`, ...), and every later read of the mutated tensor
reads the new value instead:

- mutating a base: later reads of the base read the new value; views of it taken before the
  mutation are taken again from the new value when they are next read;
- mutating a view (a slice, a select, a reshape, a transpose, ...): the new value is scattered
  back into its base (`slice_scatter`, `select_scatter`, the inverse permutation, ...), up the
  chain of views, and the base and its other views are read anew as above.

A mutation this pass cannot write functionally (a view it cannot invert, an op without an
out-of-place twin) is an AutospError naming the op and the user's line.
"""
from __future__ import annotations

import torch

from autosp.errors import AutospError
from autosp.ir.aliases import aliases
from autosp.ir.core import Eqn, Graph, Var
from autosp.ir.ops import Tag, op_for

aten = torch.ops.aten

_NO_TWIN_OK = {"detach_"}     # in-place ops that change no values


def _write_arg(e: Eqn) -> int | None:
    """Index (among e.inputs) of the tensor an in-place op writes, from its schema."""
    schema = getattr(e.op.target, "_schema", None)
    if schema is None:
        return None
    args, kwargs = e.var_args()
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            val = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(val, Var):
                return e.inputs.index(val)
    return None


def _twin(target):
    """The out-of-place overload of an in-place aten overload (`add_.Tensor` -> `add.Tensor`)."""
    packet = target.overloadpacket.__name__
    name = packet[:-1] if packet.endswith("_") else packet
    if packet == "copy_":
        return aten.copy.default
    twin_packet = getattr(aten, name, None)
    if twin_packet is None:
        return None
    return getattr(twin_packet, target._overloadname, None)


def _is_view(e: Eqn) -> bool:
    return bool(e.outputs) and not e.op.has(Tag.INPLACE) and all(a is not None for a in aliases(e))


class _Rewriter:
    """Tensor identities (the trace's vars; an in-place op's result is its target's identity),
    the var holding each identity's current value, and which identities are views of which."""

    def __init__(self):
        self.eqns: list[Eqn] = []
        self.value: dict[str, Var] = {}                # identity -> var with its current value
        self.same: dict[str, str] = {}                 # in-place result var -> the identity it returns
        self.parent: dict[str, tuple[str, Eqn]] = {}   # view identity -> (base identity, its view eqn)
        self.children: dict[str, list[str]] = {}
        self.stale: set[str] = set()                   # views whose base changed since they were read
        self.count = 0
        self.original: dict[str, Var] = {}            # name -> the traced var

    def canon(self, name: str) -> str:
        while name in self.same:
            name = self.same[name]
        return name

    def fresh(self, like: Var) -> Var:
        self.count += 1
        return Var(f"{like.name}.f{self.count}", like.dtype, like.shape, like.device, like.layout, like.role)

    def read(self, v: Var) -> Var:
        """The var holding v's current value; a stale view is taken again from its base."""
        name = self.canon(v.name)
        if name in self.stale:
            _, view = self.parent[name]
            args, kwargs = view.bind([self.read(x) for x in view.inputs])
            out = view.outputs[[self.canon(o.name) for o in view.outputs].index(name)] if view.multi else view.outputs[0]
            new = self.fresh(out)
            if view.multi:
                outs = tuple(self.fresh(o) for o in view.outputs)
                self.eqns.append(Eqn.make(view.op, args, kwargs, outs, multi=True, source=view.source))
                new = outs[[o.name for o in view.outputs].index(out.name)]
            else:
                self.eqns.append(Eqn.make(view.op, args, kwargs, (new,), source=view.source))
            self.value[name] = new
            self.stale.discard(name)
        return self.value.get(name, self.original.get(name, v))   # an in-place result reads its target

    def read_name(self, name: str) -> Var:
        return self.read(self.original[name])

    def emit(self, target, args, kwargs, like: Var, source) -> Var:
        out = self.fresh(like)
        self.eqns.append(Eqn.make(op_for(target), args, kwargs, (out,), source=source))
        return out

    def copy(self, dst: Var, src: Var, source) -> Var:
        """`dst.copy_(src)` as a value: src in dst's dtype and shape (aten.copy has no derivative)."""
        v = src
        if v.dtype != dst.dtype:
            v = self.emit(aten._to_copy.default, (v,), {"dtype": dst.dtype}, Var(src.name, dst.dtype, src.shape,
                                                                              src.device), source)
        if v.shape != dst.shape:
            v = self.emit(aten.expand.default, (v, list(dst.shape)), {}, dst, source)
            v = self.emit(aten.clone.default, (v,), {}, dst, source)
        return v

    def invalidate(self, name: str) -> None:
        for child in self.children.get(name, ()):
            self.stale.add(child)
            self.invalidate(child)

    def assign(self, name: str, new: Var, source) -> None:
        """Identity `name` now holds `new`: scatter it into its bases; its views (and its base's
        other views) are read anew when next read."""
        if name in self.parent:
            base, view = self.parent[name]
            self.assign(base, self.scatter(self.read_name(base), new, view, source), source)
        self.value[name] = new
        self.stale.discard(name)
        self.invalidate(name)

    def scatter(self, base: Var, value: Var, view: Eqn, source) -> Var:
        """`base` with the window `view` took of it replaced by `value`."""
        packet = getattr(view.op.target, "overloadpacket", None)
        name = packet.__name__ if packet is not None else view.op.name
        args, _ = view.var_args()
        rest = list(args[1:])
        like = Var(base.name, base.dtype, base.shape, base.device)
        if name == "slice":
            dim, start, end, step = (rest + [0, None, None, 1][len(rest):])[:4]
            return self.emit(aten.slice_scatter.default, (base, value, dim, start, end, step), {}, like, source)
        if name == "narrow":
            dim, start, length = rest[:3]
            return self.emit(aten.slice_scatter.default, (base, value, dim, start, start + length, 1), {}, like,
                             source)
        if name == "select":
            return self.emit(aten.select_scatter.default, (base, value, rest[0], rest[1]), {}, like, source)
        if name == "diagonal":
            return self.emit(aten.diagonal_scatter.default, (base, value, *rest), {}, like, source)
        aliased = name in ("to", "type_as") and value.dtype == base.dtype    # a cast to the dtype it has: itself
        if (name in ("view", "_unsafe_view", "reshape", "alias", "detach", "unsqueeze", "squeeze", "flatten",
                     "unflatten", "view_as", "reshape_as", "expand_as") or aliased) and value.numel() == base.numel():
            return self.emit(aten.reshape.default, (value, list(base.shape)), {}, like, source)
        if name in ("transpose", "t", "permute"):
            perm = _permutation(name, args, base.ndim)
            inverse = [perm.index(i) for i in range(len(perm))]
            return self.emit(aten.permute.default, (value, inverse), {}, like, source)
        raise AutospError(f"autosp: an in-place write through a `{view.op.name}` view at {view.source or '<no source>'} "
                          "cannot be rewritten functionally. Fix: build the result as a new tensor "
                          "(torch.cat, torch.where) instead of assigning into a view.")


def _permutation(name: str, args, ndim: int) -> list[int]:
    if name == "t":
        return list(reversed(range(ndim)))
    if name == "transpose":
        d0, d1 = (d % ndim for d in args[1:3])
        perm = list(range(ndim))
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return perm
    return [d % ndim for d in args[1]]


def functionalize(graph: Graph) -> Graph:
    if not any(e.op.has(Tag.INPLACE) for e in graph.eqns):
        return graph
    rw = _Rewriter()
    rw.original = {v.name: v for v in graph.inputs}
    rw.original.update({v.name: v for v, _ in graph.consts})
    for e in graph.eqns:
        rw.original.update({o.name: o for o in e.outputs})
    for e in graph.eqns:
        if e.op.has(Tag.INPLACE):
            k = _write_arg(e)
            if k is None:
                raise AutospError(f"autosp: `{e.op.name}` at {e.source or '<no source>'} writes in place to an "
                                  "argument autosp cannot identify. Fix: use the out-of-place op.")
            target = rw.canon(e.inputs[k].name)
            if e.op.name.split(".")[0] not in _NO_TWIN_OK:
                twin = _twin(e.op.target)
                if twin is None:
                    raise AutospError(f"autosp: `{e.op.name}` at {e.source or '<no source>'} has no out-of-place "
                                      "twin that autosp knows. Fix: use the out-of-place op.")
                ins = [rw.read(x) for x in e.inputs]
                if twin is aten.copy.default:
                    new = rw.copy(ins[0], ins[1], e.source)
                else:
                    args, kwargs = e.bind(ins)
                    new = rw.emit(twin, args, kwargs, rw.original[target], e.source)
                rw.assign(target, new, e.source)
            for o in e.outputs:                 # the op returns the tensor it wrote
                rw.same[o.name] = target
            continue
        original = e
        ins = [rw.read(x) for x in e.inputs]
        if any(a is not b for a, b in zip(ins, e.inputs)):
            e = e.replace(inputs=tuple(ins))
        rw.eqns.append(e)
        if _is_view(original):
            for o, a in zip(original.outputs, aliases(original)):
                base = rw.canon(original.inputs[a].name)
                rw.parent[o.name] = (base, original)     # the view as traced: re-read by identity
                rw.children.setdefault(base, []).append(o.name)
    outputs = tuple(rw.read(o) if isinstance(o, Var) else o for o in graph.outputs)
    return graph.replace(eqns=tuple(rw.eqns), outputs=outputs, name="functionalize")

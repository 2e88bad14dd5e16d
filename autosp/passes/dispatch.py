"""Token-dispatch regions: MoE experts run on rows sorted by expert, found in the graph.

    ids_g, perm = sort(expert_ids)                       # the rows: (tokens x top-k), sequence inside
    ... x[perm // k], w[perm], offsets = cumsum(histc(ids_g)),
        grouped_mm(rows, experts, offsets), elementwise ...
    inv = index_put(empty_like(perm), [perm], arange(n))  # the inverse permutation
    y = out[inv]                                          # back in token order

(transformers' grouped_mm experts; autosp/decompositions.py.) Each op in
between either works row by row, or moves rows by the region's own permutation, or counts rows
per expert for the offsets; routing is per token, so every row of `y` depends on its own token
alone. Each rank therefore runs the whole region on its own rows: it sorts them, counts them,
multiplies them by their experts and un-sorts them, and `y` is its chunk of the global `y`
with no collective. The sort alone would mix positions (shard_rules falls back to the gather),
which is why the region is rewritten whole. A region whose counts are used for anything but
offsets (capacity limits, per-expert normalisation), or whose sorted values escape, is not one:
those ops keep their ordinary rules.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autosp.ir.core import Eqn, Graph, Var
from autosp.ir.ops import Tag

aten = torch.ops.aten

# ops that may run inside a region on the rank's rows, besides elementwise ones
_INNER = {"view", "reshape", "_unsafe_view", "expand", "permute", "transpose", "t", "unsqueeze", "squeeze",
          "contiguous", "alias", "clone", "detach", "to.dtype", "to.device", "to.dtype_layout", "to.other",
          "_to_copy.default", "type_as.default", "where.self", "masked_fill.Scalar", "masked_fill.Tensor",
          "chunk", "split", "split_with_sizes", "index", "grouped_mm", "empty_like", "zeros_like",
          "new_zeros", "new_empty", "new_ones", "new_full", "clamp.default", "floor_divide.default"}


@dataclass(frozen=True, slots=True)
class DispatchRegion:
    eqns: frozenset[int]    # the sort, the closing index by the inverse permutation, everything between
    rows: Var               # the sorted value (1-D): its layout is the rank's rows

    def __contains__(self, k: int) -> bool:
        return k in self.eqns


def find_dispatch_regions(graph: Graph, pos: dict, free: set[str]) -> list[DispatchRegion]:
    """Regions that start at a sort of a 1-D value whose dim carries the sequence (`pos`) and end
    where its permutation is undone; `free` names the input-free values (arange, ...)."""
    producer, readers, outputs = graph.index()
    regions = []
    for s_idx, s in enumerate(graph.eqns):
        if s.op.name not in ("sort", "argsort") or s.inputs[0].ndim != 1 or s.inputs[0].name not in pos:
            continue
        region = _grow(graph, s_idx, producer, readers, outputs, pos, free)
        if region is not None:
            regions.append(DispatchRegion(frozenset(region), s.inputs[0]))
    return regions


def _grow(graph, s_idx, producer, readers, outputs, pos, free) -> set[int] | None:
    s = graph.eqns[s_idx]
    n = s.inputs[0].shape[0]
    perm = s.outputs[-1] if s.op.name == "sort" else s.outputs[0]
    closers = _closers(graph, perm, n, producer, readers)
    if not closers:
        return None
    inner, frontier = {s_idx}, [o.name for o in s.outputs]
    while frontier:
        name = frontier.pop()
        if name in outputs:
            return None
        for r in readers.get(name, ()):
            if r in inner or r in closers:
                continue
            e = graph.eqns[r]
            if not (e.op.has(Tag.ELEMENTWISE) or e.op.name in _INNER or _counts_are_offsets(graph, r, readers, producer)
                    or _along_columns(e)
                    or e.op.name == "cumsum" and _is_count(graph, e.inputs[0], producer)):
                return None
            inner.add(r)
            frontier.extend(o.name for o in e.outputs)
    inner |= closers
    # input-free values with the rows (arange): made inside, at this rank's size, if nothing else reads them
    changed = True
    while changed:
        changed = False
        for k in sorted(inner):
            for x in graph.eqns[k].inputs:
                p = producer.get(x.name)
                if p is None or p in inner or x.name not in free:
                    continue
                e = graph.eqns[p]
                if any(r not in inner for o in e.outputs for r in readers.get(o.name, ())):
                    return None
                if e.op.has(Tag.CREATION) and not (e.op.name == "arange" and _arange_end(e) == n):
                    return None
                inner.add(p)
                changed = True
    # values from outside with the rows are in token order: only the sort and row gathers x[perm] may read them
    made = {o.name for k in inner for o in graph.eqns[k].outputs}
    for k in inner - {s_idx}:
        e = graph.eqns[k]
        if any(x.name in pos and x.name not in made and not (e.op.name == "index" and j == 0)
               for j, x in enumerate(e.inputs)):
            return None
    return inner


def _along_columns(e: Eqn) -> bool:
    """A slice of each row's columns (gpt-oss's interleaved gate and up halves): row by row."""
    if e.op.name not in ("slice", "narrow") or not e.inputs or e.inputs[0].ndim < 2:
        return False
    return e.bind_schema().get("dim", 0) % e.inputs[0].ndim != 0


def _closers(graph, perm, n, producer, readers) -> set[int]:
    """`index(y, [inv])` equations, with inv = index_put(base, [perm], arange(n)): back in token order."""
    found = set()
    for r in readers.get(perm.name, ()):
        e = graph.eqns[r]
        if e.op.name != "index_put" or len(e.inputs) != 3 or e.inputs[1].name != perm.name:
            continue
        src = producer.get(e.inputs[2].name)
        if src is None or graph.eqns[src].op.name != "arange" or _arange_end(graph.eqns[src]) != n:
            continue
        inv = e.outputs[0]
        uses = readers.get(inv.name, ())
        if uses and all(graph.eqns[u].op.name == "index" and len(graph.eqns[u].inputs) == 2
                        and graph.eqns[u].inputs[1].name == inv.name for u in uses):
            found |= {r, *uses}
    return found


def _arange_end(e: Eqn):
    args, kwargs = e.var_args()
    return args[0] if e.op.target is aten.arange.default and args else None


_CASTS = {"to.dtype", "_to_copy.default", "to.dtype_layout"}


def _is_count(graph, x, producer) -> bool:
    p = producer.get(x.name)
    while p is not None and graph.eqns[p].op.name in _CASTS:       # counts cast back to the ids' dtype
        p = producer.get(graph.eqns[p].inputs[0].name)
    return p is not None and graph.eqns[p].op.name == "histc"


def _counts_are_offsets(graph, k, readers, producer) -> bool:
    """histc whose counts only become offsets: cumsum (perhaps of a cast), read only as grouped_mm's offsets."""
    e = graph.eqns[k]
    if e.op.name not in ("histc", *_CASTS) or e.op.name in _CASTS and not _is_count(graph, e.outputs[0], producer):
        return False
    for r in readers.get(e.outputs[0].name, ()):
        c = graph.eqns[r]
        if c.op.name in _CASTS and _counts_are_offsets(graph, r, readers, producer):
            continue
        if c.op.name != "cumsum":
            return False
        for u in readers.get(c.outputs[0].name, ()):
            g = graph.eqns[u]
            if g.op.name != "grouped_mm" or [x.name for x in g.inputs].index(c.outputs[0].name) != 2:
                return False
    return True


# ---------------------------------------------------------------- the rule

def dispatch_rule(ctx, e: Eqn, region: DispatchRegion) -> None:
    """One equation of a region, run on this rank's rows: sorts, gathers and scatters by the region's
    permutation stay local, counts are this rank's (no all-reduce), aranges span this rank's rows."""
    from autosp.passes.shard_rules import creation_rule, positionwise
    if e.op.name == "arange":
        rows = ctx.layout_for(region.rows)
        args, kwargs = e.bind([ctx.env[x.name] for x in e.inputs])
        ctx.env[e.outputs[0].name] = ctx.emit(e.op.target, (rows.local_size(),) + tuple(args[1:]), kwargs,
                                              source=e.source, layouts=[rows])
    elif e.op.name == "histc":
        args, kwargs = e.bind([ctx.env[x.name] for x in e.inputs])
        ctx.env[e.outputs[0].name] = ctx.emit(e.op.target, args, kwargs, source=e.source)
    elif e.op.has(Tag.CREATION) and e.op.name.endswith("_like"):
        positionwise(ctx, e, force=True)
    elif e.op.has(Tag.CREATION) and e.outputs[0].name in ctx.pos:
        creation_rule(ctx, e)
    elif e.op.has(Tag.CREATION):                 # its inputs give a dtype and a device, never a gather
        args, kwargs = e.bind([ctx.env[x.name] for x in e.inputs])
        ctx.env[e.outputs[0].name] = ctx.emit(e.op.target, args, kwargs, source=e.source)
    else:
        positionwise(ctx, e, force=True)

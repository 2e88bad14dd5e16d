"""Head-parallel regions beyond attention: code that mixes positions along the whole sequence but keeps
heads (or channels) independent -- a chunked recurrence (gated delta rule, KDA, Mamba-2's SSD), a scan
(Mamba-1), lightning attention -- found in the traced program, not from model names.

    whole activations  [b, s, h, d]  --all-to-all-->  [b, s_full, h/P, d]      (entries)
    the region: blocks sliced out of the sequence, chunked reshapes, cumsums, state carried from block
                to block, the blocks joined again -- every op independent along the head dim
    whole results      [b, s_full, h/P, d]  --all-to-all-->  [b, s/P, h, d]    (exits)

A region grows from its seeds -- equations that read a whole-sequence activation and mix its positions
(a slice or a pad along the sequence, a cumsum along it, a reshape that splits it into chunks, a matmul
that contracts it) -- through every equation that reads or makes a value that is no longer the whole
sequence, and stops at whole-sequence values again. It is one only if one dim of its entries stays
independent through every equation (dim links, `seqdims.links_for`, and no op acting along it); that dim
is split over sp, Ulysses-style. Entries without such a dim (Mamba-2's B and C, shared by all heads) are
read whole; values from outside (decay tables, a zero state) are cut to this rank's heads. Anything
else keeps its sequence-sharded rules, so a region that does not check out changes nothing.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from autosp.ir.core import Eqn, Graph, Var
from autosp.passes.seqdims import LINK_RULES, SeqPos, infer_seq_positions, links_for, reshape_pos, token_id_seeds

# ops that pick or shift positions along a dim: mixing when that dim is the sequence
_ALONG = {"slice", "narrow", "select", "split", "split_with_sizes", "chunk", "unbind", "index_select", "tensor_split.indices",
          "cumsum", "cumprod", "flip", "roll", "diff", "unfold", "logcumsumexp"}
_PAD = {"pad", "constant_pad_nd"}
_TRI = {"tril", "triu"}
_MATMUL = {"matmul", "bmm", "mm"}
_RESHAPE = {"view", "reshape", "_unsafe_view"}
# ops whose shape argument is the output's shape: rewritten to the local one inside a region
SHAPE_ARGS = {"view": "size", "reshape": "shape", "_unsafe_view": "size", "expand": "size",
              "new_zeros": "size", "new_ones": "size", "new_empty": "size", "new_full": "size"}
# ops that move data without acting along any dim (their dim arguments name dims, not an operation)
_MOVES = {"transpose", "permute", "t", "movedim", "unsqueeze", "squeeze", "view", "reshape", "_unsafe_view",
          "expand", "flatten", "unflatten", "contiguous", "clone", "alias", "detach"}


@dataclass(frozen=True, slots=True)
class SeqRegion:
    eqns: frozenset[int]           # the region's equations
    head: dict[str, SeqPos]        # old var name -> its head dim (entries, values made inside, outside inputs)
    entries: frozenset[str]        # whole-sequence activations read inside (all-to-all, or read whole)
    exits: frozenset[str]          # values made inside and read after it (back to sequence-sharded)
    heads: int                     # the number of heads split over sp (the entries' largest)

    def __contains__(self, k: int) -> bool:
        return k in self.eqns

    def describe(self, graph: Graph) -> str:
        ops = sorted({graph.eqns[k].op.name for k in self.eqns})
        return (f"head-parallel region of {len(self.eqns)} equations over {self.heads} heads "
                f"({', '.join(ops[:8])}{', ...' if len(ops) > 8 else ''})")


def _dims(e: Eqn) -> list[int]:
    b = e.bind_schema()
    out = []
    for key in ("dim", "dims", "dim0", "dim1"):
        d = b.get(key)
        if d is None:
            continue
        out.extend(d if isinstance(d, (list, tuple)) else [d])
    return out


def _norm(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _mixes(e: Eqn, x: Var, p: SeqPos, pos: dict) -> bool:
    """Does `e` combine or move positions of x's sequence (x whole, at p)?"""
    name = e.op.name
    sd = p.dim
    if name in _ALONG:
        dims = {_norm(d, x.ndim) for d in _dims(e)} or {0}
        if sd not in dims:
            return False
        if name in ("slice", "narrow", "tensor_split.indices"):   # a no-op slice keeps the sequence whole
            return any(0 < o.shape[sd] < x.shape[sd] for o in e.outputs)
        return True
    if name in _PAD:
        pad = e.bind_schema().get("pad") or []
        k = x.ndim - 1 - sd
        return len(pad) > 2 * k + 1 and (pad[2 * k] != 0 or pad[2 * k + 1] != 0)
    if name in _TRI:
        return sd >= x.ndim - 2
    if name in _MATMUL:
        # the sequence contracted (k^T v), or a sequence on both sides (q k^T): positions meet
        a, b = e.inputs[0], e.inputs[1]
        pa, pb = pos.get(a.name), pos.get(b.name)
        if b.ndim < 2 or a.ndim < 2:
            return False
        rows = pa is not None and pa.dim == a.ndim - 2
        cols = pb is not None and pb.dim == b.ndim - 1
        return (pa is not None and pa.dim == a.ndim - 1) or (pb is not None and pb.dim == b.ndim - 2) \
            or (rows and cols)
    if name in _RESHAPE:
        out = e.outputs[0]
        return p.outer == 1 and p.inner == 1 and reshape_pos(x.shape, out.shape, p) is None
    return False


def find_seq_regions(graph: Graph, pos: dict[str, SeqPos], heavy: set[str], length: int, ranks: int,
                     skip: set[int] = frozenset()) -> list[SeqRegion]:
    """Head-parallel regions of a global forward graph (`pos`: sequence dims, `heavy`: activations,
    `length`: the sequence length, `ranks`: sp; `skip`: equations already claimed by attention)."""
    if not length:
        return []
    # calls of ops declared with autosp.sequence_op: a region of one equation each, its head dims declared
    from autosp.sequence_op import declared_regions
    declared = declared_regions(graph, pos, heavy, length, ranks, skip)
    skip = set(skip) | {k for r in declared for k in r.eqns}
    producer, readers, outputs = graph.index()

    def whole(v: Var) -> bool:
        # the sequence in one plain dim; a value with two (scores of a block that spans the whole sequence)
        # is pairs of positions, made and read inside a region
        p = pos.get(v.name)
        return (v.dtype is not None and p is not None and 0 <= p.dim < v.ndim
                and p.length(v) == length and p.outer == 1 and p.inner == 1 and v.shape.count(length) == 1)

    seeds = []
    for k, e in enumerate(graph.eqns):
        if k in skip or e.op.name == "attention":
            continue
        for x in e.inputs:
            if x.name in heavy and whole(x) and _mixes(e, x, pos[x.name], pos):
                seeds.append(k)
                break
    # the batch dim, found as the sequence is (from the token ids), is never the one split
    batch = infer_seq_positions(graph, {n: SeqPos(0) for n, p in token_id_seeds(graph).items() if p.dim == 1},
                                attention=False)
    grown: list[set[int]] = []
    spoilt: set[int] = set()
    for seed in seeds:
        if any(seed in g for g in grown) or seed in spoilt:
            continue
        eqns = _grow(graph, seed, producer, readers, outputs, whole, heavy, pos, skip)
        if eqns is None:
            spoilt.add(seed)
            continue
        # growth from another seed of the same recurrence meets this one: one region
        for g in [g for g in grown if g & eqns]:
            grown.remove(g)
            eqns |= g
        grown.append(eqns)
    regions = []
    for eqns in sorted(grown, key=min):
        region = _heads(graph, eqns, producer, readers, outputs, whole, heavy, batch, pos, ranks)
        if region is not None:
            regions.append(region)
    return sorted(declared + regions, key=lambda r: min(r.eqns))


def _grow(graph, seed, producer, readers, outputs, whole, heavy, pos, skip) -> set[int] | None:
    """The seed's region: forward through values that are not the whole sequence, back through their
    makers; None when a part of the sequence escapes (a graph output, an attention op)."""
    eqns, work = {seed}, [seed]
    while work:
        k = work.pop()
        e = graph.eqns[k]
        for o in e.outputs:
            if o.dtype is None or whole(o):
                continue
            if o.name in outputs:
                return None
            for r in readers.get(o.name, ()):
                if r not in eqns:
                    if r in skip or graph.eqns[r].op.name == "attention":
                        return None
                    eqns.add(r)
                    work.append(r)
        for x in e.inputs:
            j = producer.get(x.name)
            if j is None or j in eqns or whole(x) or x.name not in heavy or x.name not in pos:
                continue
            if j in skip:
                return None
            eqns.add(j)
            work.append(j)
    return eqns


def _heads(graph, eqns, producer, readers, outputs, whole, heavy, batch, pos, ranks) -> SeqRegion | None:
    """The region with a head dim for its values, or None when no dim of its entries stays independent."""
    order = sorted(eqns)
    made = {o.name for k in order for o in graph.eqns[k].outputs}
    entries = []
    for k in order:
        for x in graph.eqns[k].inputs:
            if x.name not in made and x.name in heavy and whole(x) and x.name not in entries:
                entries.append(x.name)
    exits = {o.name for k in order for o in graph.eqns[k].outputs
             if o.name in outputs or any(r not in eqns for r in readers.get(o.name, ()))}
    if not entries or not exits or any(not whole(_var(graph, n, producer)) for n in exits if n in made):
        return None
    adj: dict[str, list] = defaultdict(list)
    for k in order:
        for a, b, fwd, bwd in links_for(graph.eqns[k]):
            adj[a.name].append((b, fwd))
            adj[b.name].append((a, bwd))
    head: dict[str, SeqPos] = {}
    for name in entries:
        if name in head:
            continue
        v = _var(graph, name, producer)
        seq = pos[name].dim
        b = batch.get(name)
        dims = [d for d in range(v.ndim) if d != seq and (b is None or b.dim != d) and v.shape[d] > 1]
        # a dim the ranks divide first; one they do not is still the region's (the rule says how to fix it)
        for d in sorted(dims, key=lambda d: v.shape[d] % ranks != 0):
            trial = _spread(dict(head), name, SeqPos(d), adj)
            if trial is not None and _independent(graph, order, trial):
                head = trial
                break
    if not head:
        return None
    for n in exits:
        v = _var(graph, n, producer)
        if n in head and (pos.get(n) is None or not whole(v)):
            return None
    heads = max(_var(graph, n, producer).shape[head[n].dim] // (head[n].outer * head[n].inner)
                for n in entries if n in head)
    return SeqRegion(frozenset(eqns), head, frozenset(entries), frozenset(exits), heads)


def _var(graph: Graph, name: str, producer) -> Var:
    k = producer.get(name)
    if k is not None:
        return next(o for o in graph.eqns[k].outputs if o.name == name)
    return next(v for v in list(graph.inputs) + [c for c, _ in graph.consts] if v.name == name)


def _spread(head: dict[str, SeqPos], name: str, p: SeqPos, adj) -> dict[str, SeqPos] | None:
    """Spread a head dim along the region's dim links; None on a conflict."""
    if name in head:
        return head if head[name] == p else None
    head[name] = p
    work = [name]
    while work:
        n = work.pop()
        for other, f in adj.get(n, ()):
            q = f(head[n])
            if q is None or not (0 <= q.dim < other.ndim) or other.shape[q.dim] % (q.outer * q.inner):
                continue
            if q.length(other) <= 1:
                continue
            if other.name in head:
                if head[other.name] != q:
                    return None
                continue
            head[other.name] = q
            work.append(other.name)
    return head


def _independent(graph, order, head) -> bool:
    """Every equation keeps the head dim: its outputs carry it where an input does, no op acts along it."""
    for k in order:
        e = graph.eqns[k]
        ins = [x for x in e.inputs if x.name in head]
        if not ins:
            continue
        for o in e.outputs:
            if o.dtype is not None and o.dtype.is_floating_point and o.ndim and o.name not in head:
                return False
        if not _keeps_heads(e, head):
            return False
        if e.op.name not in _MOVES:
            # stack's dim names a dim of its output; every other op's, a dim of its input
            x = e.outputs[0] if e.op.name == "stack" else ins[0]
            if x.name in head and any(_norm(d, x.ndim) == head[x.name].dim for d in _dims(e) if isinstance(d, int)):
                return False
        if e.op.name in ("index", "index_put", "_index_put_impl", "scatter", "gather", "index_select"):
            return False
    return True


def _keeps_heads(e: Eqn, head) -> bool:
    """No input's head dim is contracted or reduced away (Mamba-1's C . state), or lands elsewhere. A ruled op's
    link maps every dim it keeps; a probed op's (seqdims.links_for asks the op itself) one dim each, so
    there a head no link names is unknown, not lost."""
    ruled = e.op.name in LINK_RULES
    found: dict[tuple[str, str], list] = defaultdict(list)
    for a, b, fwd, _ in links_for(e):
        if a.name in head and b.name in head:
            found[(a.name, b.name)].append(fwd(head[a.name]))
    for (a, b), qs in found.items():
        if head[b] in qs:
            continue
        if any(q is not None for q in qs) or ruled:
            return False
    return True


def local_shape(v: Var, p: SeqPos | None, ranks: int) -> list[int]:
    shape = list(v.shape)
    if p is not None:
        shape[p.dim] //= ranks
    return shape


def is_shape_op(e: Eqn) -> bool:
    return e.op.name in SHAPE_ARGS


def with_local_shape(e: Eqn, args: tuple, kwargs: dict, shape: list[int]) -> tuple[tuple, dict]:
    """The op's arguments with its shape argument replaced by the output's local shape."""
    key = SHAPE_ARGS[e.op.name]
    schema = e.op.target._schema if isinstance(e.op.target, torch._ops.OpOverload) else None
    names = [a.name for a in schema.arguments] if schema is not None else []
    if key in kwargs:
        kwargs = {**kwargs, key: shape}
    elif key in names and names.index(key) < len(args):
        args = args[:names.index(key)] + (shape,) + args[names.index(key) + 1:]
    elif len(args) > 1:
        args = (args[0], shape) + args[2:]
    return args, kwargs


# ---------------------------------------------------------------- the rewrite

def seq_region_rule(ctx, e: Eqn, region: SeqRegion) -> None:
    """One equation of a head-parallel region, on this rank's heads over the whole sequence. Entries go
    to the head-sharded form once (all-to-all; read whole where they have no head dim), values from
    outside are cut to this rank's heads, exits come back sequence-sharded right where they are made."""
    from autosp import collectives as C
    from autosp.errors import ShardError
    p = ctx.mesh.sp_size
    inside = ctx._cache.setdefault(("seq_region", id(region)), {})
    for v in (*e.inputs, *e.outputs):
        hp = region.head.get(v.name)
        if hp is not None and hp.length(v) % p:
            raise ShardError(
                f"autosp.shard: the head-parallel region at {e.source or '<no source line>'} splits "
                f"{hp.length(v)} heads of {v.type_str()} over sp={p}. Fix: use an sp size that divides "
                f"{hp.length(v)}, or keep this model's sequence whole (sp=1).")

    def read(x: Var) -> Var:
        if x.name in inside:
            return inside[x.name]
        hp = region.head.get(x.name)
        if x.name in region.entries:
            new = _to_heads(ctx, x, hp, e.source) if hp is not None else ctx.as_replicated(x, e.source)
        else:
            new = ctx.as_replicated(x, e.source)
            if hp is not None:
                new = ctx.emit(C.shard_slice, (new, hp.dim, hp.outer, hp.length(x) // p, hp.inner,
                                               ctx.mesh.sp_group), source=e.source)
        inside[x.name] = new
        return new

    ins = [read(x) for x in e.inputs]
    args, kwargs = e.bind(ins)
    if is_shape_op(e):
        args, kwargs = with_local_shape(e, args, kwargs, local_shape(e.outputs[0], region.head.get(e.outputs[0].name), p))
    target = e.op.target
    if e.op.name in ("view", "_unsafe_view"):
        target = torch.ops.aten.reshape.default     # an all-to-all's output is contiguous where the trace's was not
    outs = ctx.emit(target, args, kwargs, source=e.source)
    outs = outs if isinstance(outs, tuple) else ((outs,) if outs is not None else ())
    for old, new in zip(e.outputs, outs):
        inside[old.name] = new
        if old.name in region.exits:
            ctx.env[old.name] = _from_heads(ctx, old, new, region.head.get(old.name), e.source)


def _to_heads(ctx, x: Var, hp: SeqPos, source=None) -> Var:
    """A whole-sequence activation, sequence-sharded now, as this rank's heads over the whole sequence."""
    from autosp import collectives as C
    torch_aten = torch.ops.aten
    s = ctx.as_sharded(x, source)
    p = ctx.mesh.sp_size
    lay = s.layout
    if lay is None or lay.outer != 1 or lay.inner != 1 or hp.outer != 1:
        full = ctx.as_replicated(x, source)
        return ctx.emit(C.shard_slice, (full, hp.dim, hp.outer, hp.length(x) // p, hp.inner, ctx.mesh.sp_group),
                        source=source)
    (y,) = ctx.emit(C.all_to_all, ([s], hp.dim, lay.dim, ctx.mesh.sp_group), source=source)
    if y.shape[lay.dim] != lay.length:
        y = ctx.emit(torch_aten.narrow.default, (y, lay.dim, 0, lay.length), source=source)
    return y


def _from_heads(ctx, old: Var, new: Var, hp: SeqPos | None, source) -> Var:
    """A value made in the region (this rank's heads, the whole sequence) back to sequence-sharded."""
    from autosp import collectives as C
    from autosp.layout import Layout
    torch_aten = torch.ops.aten
    if hp is None:                      # made from whole values only: replicated
        ctx.rep[old.name] = new
        return ctx.shard(new, old, source) if ctx.wants_shard(old) else new
    sp = ctx.pos[old.name]
    padded = ctx.chunk * ctx.mesh.sp_size
    length = old.shape[sp.dim]
    if padded != length:
        pad = [0, 0] * (new.ndim - 1 - sp.dim) + [0, padded - length]
        new = ctx.emit(torch_aten.constant_pad_nd.default, (new, pad), source=source)
    (y,) = ctx.emit(C.all_to_all, ([new], sp.dim, hp.dim, ctx.mesh.sp_group), source=source,
                    layouts=[Layout(sp.dim, length, ctx.chunk)])
    return y

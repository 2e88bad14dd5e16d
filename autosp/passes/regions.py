"""Head-parallel regions: attention written without SDPA, found in the graph.

    scores = matmul(q, transpose(k, -1, -2))        # [.., h, L, L]
    ... elementwise, softcap, + mask, softmax(-1), dropout, casts ...
    out = matmul(probs, v)                          # [.., h, L, dv]

Every op between the two matmuls is independent across heads, so Ulysses runs the whole region
on the full sequence for h/P heads, as it runs SDPA: one all-to-all brings q, k and v to
`b (sp h) s d` before it, one brings the output back after it (shard_rules.region_rule). Masks
and biases from outside the region are read whole (and cut to this rank's heads when they have
a head dim). A region whose inner values escape (attention weights returned to the caller) is
not one: those ops keep their ordinary rules.
"""
from __future__ import annotations

from dataclasses import dataclass

from autosp.ir.core import Eqn, Graph, Var
from autosp.ir.ops import Tag

# ops that may sit between the two matmuls: position-wise over the scores, softmax over keys
_INNER = {"softmax", "_softmax", "dropout", "native_dropout", "to.dtype", "to.device", "to.dtype_layout", "to.other",
          "_to_copy.default", "type_as.default", "clone", "contiguous", "alias", "detach", "where.self",
          "masked_fill.Scalar", "masked_fill.Tensor"}

# ops along the keys of each query's row (dim -1 only)
_ROW_OPS = {"cat", "max", "amax", "logsumexp", "slice", "narrow", "sum"}


@dataclass(frozen=True, slots=True)
class AttentionRegion:
    q: Var                  # [.., h, L, d]
    k: Var                  # [.., h, L, d] (before its transpose)
    v: Var                  # [.., h, L, dv]
    out: Var                # [.., h, L, dv]
    eqns: frozenset[int]    # the region's equations (the k transpose, both matmuls and what is between)
    last: int               # index of the second matmul: the region is emitted there

    def __contains__(self, k: int) -> bool:
        return k in self.eqns


def _swaps_last_two(e: Eqn) -> bool:
    if not e.inputs or not e.outputs:             # a fresh buffer (a recurrence's zero state)
        return False
    x, out = e.inputs[0], e.outputs[0]
    if x.ndim < 2 or out.shape != x.shape[:-2] + (x.shape[-1], x.shape[-2]):
        return False
    args, _ = e.var_args()
    if e.op.name == "transpose":
        return {a % x.ndim for a in args[1:3]} == {x.ndim - 1, x.ndim - 2}
    if e.op.name == "permute":
        perm = [a % x.ndim for a in args[1]]
        return perm == list(range(x.ndim - 2)) + [x.ndim - 1, x.ndim - 2]
    return e.op.name == "t"


def find_regions(graph: Graph) -> list[AttentionRegion]:
    producer, readers, outputs = graph.index()
    regions = []
    for a_idx, a in enumerate(graph.eqns):
        if a.op.name != "matmul" or len(a.inputs) != 2 or a.inputs[0].ndim < 4:
            continue
        x, y = a.inputs
        t_idx = producer.get(y.name)
        if t_idx is None or not _swaps_last_two(graph.eqns[t_idx]) or readers.get(y.name) != [a_idx]:
            continue
        k = graph.eqns[t_idx].inputs[0]
        length = x.shape[-2]
        if k.shape[-2] != length or length <= 1 or a.outputs[0].shape[-2:] != (length, length):
            continue
        # follow the scores to the matmul with v
        inner, frontier, b_idx = {a_idx}, [a.outputs[0].name], None
        ok = True
        while frontier and ok:
            name = frontier.pop()
            if name in outputs:
                ok = False
                break
            for r in readers.get(name, ()):
                e = graph.eqns[r]
                if r in inner:
                    continue
                if e.op.name == "matmul" and e.inputs[0].name == name and len(e.inputs) == 2 \
                        and e.inputs[1].shape[-2] == length and e.inputs[1].name not in _names(graph, inner):
                    if b_idx not in (None, r):
                        ok = False
                        break
                    b_idx = r
                    continue
                shape_kept = all(o.ndim == 0 or o.ndim >= 2 and o.shape[-2] == length for o in e.outputs if o.dtype)
                if (e.op.has(Tag.ELEMENTWISE) or e.op.name in _INNER) and shape_kept or _along_keys(e, length):
                    inner.add(r)
                    frontier.extend(o.name for o in e.outputs)
                else:
                    ok = False
                    break
        if not ok or b_idx is None:
            continue
        b = graph.eqns[b_idx]
        v, out = b.inputs[1], b.outputs[0]
        if v.ndim != x.ndim or out.shape[-2] != length:
            continue
        regions.append(AttentionRegion(x, k, v, out,
                                       frozenset(inner | {t_idx, b_idx}), b_idx))
    return regions


def _along_keys(e: Eqn, length: int) -> bool:
    """An op over each query's row of scores alone: a sink logit joined to the keys (gpt-oss), the row's
    max taken off, the sink column dropped again -- every output keeps the queries in dim -2."""
    if e.op.name not in _ROW_OPS or not e.outputs or e.inputs[0].ndim < 2:
        return False
    x = e.inputs[0] if e.op.name != "cat" else None
    if any(o.dtype is not None and (o.ndim < 2 or o.shape[-2] != length) for o in e.outputs):
        return False
    dims = e.bind_schema().get("dim")
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    ndim = e.outputs[0].ndim
    return all(isinstance(d, int) and d % ndim == ndim - 1 for d in dims) and (x is None or x.shape[-2] == length)


def _names(graph: Graph, idx) -> set[str]:
    return {o.name for k in idx for o in graph.eqns[k].outputs}

"""Find the sequence dim of every value: seeded at attention (SDPA's L), spread by dim links.

Each op family contributes links between an input dim and an output dim that index
the same positions. The sequence found at attention's Q/K/V spreads along links in
both directions, to the token ids, the labels, the position ids and the logits.
A position is (dim, outer, inner): the sequence is the middle factor of a dim that
may be a merge such as (b s).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch

from autosp.errors import ShardError
from autosp.ir.core import Eqn, Graph, Var
from autosp.ir.ops import Tag


@dataclass(frozen=True, slots=True)
class SeqPos:
    dim: int
    outer: int = 1
    inner: int = 1

    def length(self, var: Var) -> int:
        return var.shape[self.dim] // (self.outer * self.inner)


Map = Callable[[SeqPos], "SeqPos | None"]
Link = tuple[Var, Var, Map, Map]


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def dim_link(a: Var, b: Var, mapping: dict[int, int]) -> Link:
    """Link dims a[i] <-> b[mapping[i]]; merged positions keep their factors."""
    inv = {v: k for k, v in mapping.items()}
    fwd = lambda p: SeqPos(mapping[p.dim], p.outer, p.inner) if p.dim in mapping else None
    bwd = lambda p: SeqPos(inv[p.dim], p.outer, p.inner) if p.dim in inv else None
    return (a, b, fwd, bwd)


def reshape_pos(src: tuple[int, ...], dst: tuple[int, ...], p: SeqPos) -> SeqPos | None:
    """Where a sequence at `p` in a contiguous `src` lands in `dst` (None if split across dims)."""
    length = src[p.dim] // (p.outer * p.inner)
    if length <= 1:
        return None
    stride = p.inner * _prod(src[p.dim + 1:])
    suffix = 1
    for j in reversed(range(len(dst))):
        size = dst[j]
        if stride % suffix == 0 and (suffix * size) % (stride * length) == 0:
            inner = stride // suffix
            return SeqPos(j, size // (inner * length), inner)
        suffix *= size
        if suffix > stride:
            break
    return None


def _aligned(x: Var, out: Var) -> dict[int, int]:
    off = out.ndim - x.ndim
    return {i: i + off for i in range(x.ndim)
            if i + off >= 0 and x.shape[i] == out.shape[i + off] and x.shape[i] != 1}


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _arg(e: Eqn, i: int, name: str, default=None):
    args, kwargs = e.var_args()
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


# ---------------------------------------------------------------- link rules, one per op family

def links_same(e: Eqn) -> list[Link]:
    """Broadcasting position-wise ops: dims aligned from the right with equal sizes."""
    out = e.outputs[0]
    return [dim_link(x, out, _aligned(x, out)) for x in e.inputs if x.dtype is not None]


def links_index(e: Eqn) -> list[Link]:
    """slice / pad / roll / cumsum: every dim keeps its meaning (the sliced one changes length)."""
    x, out = e.inputs[0], e.outputs[0]
    return [dim_link(x, out, {i: i for i in range(x.ndim)})] if x.ndim == out.ndim else []


def links_linear(e: Eqn) -> list[Link]:
    x, out = e.inputs[0], e.outputs[0]
    return [dim_link(x, out, {i: i for i in range(x.ndim - 1)})]


def links_matmul(e: Eqn) -> list[Link]:
    out = e.outputs[0]
    a, b = e.inputs[0], e.inputs[1] if len(e.inputs) > 1 else None
    rows = {i: i + out.ndim - a.ndim for i in range(a.ndim - 1) if i + out.ndim - a.ndim >= 0}
    res = [dim_link(a, out, rows)]
    if b is not None and b.ndim >= 2:
        m = {b.ndim - 1: out.ndim - 1}
        m.update({i: i + out.ndim - b.ndim for i in range(b.ndim - 2) if b.shape[i] != 1})
        link = dim_link(b, out, m)
        if any(j < out.ndim - 1 and out.shape[j] == out.shape[-1] for j in rows.values()):
            # scores of every row against every column (an indexer's q @ k^T): two sequence dims. The
            # rows are the sequence (each rank its queries, the columns whole: query_rows.py), whichever
            # side the search reaches the value from first
            link = WeakLink(link)
        res.append(link)
    return res


class WeakLink(tuple):
    """A link that places a sequence only where no ordinary link does (infer_seq_positions tries it last)."""
    __slots__ = ()


def links_embedding(e: Eqn) -> list[Link]:
    ids, out = e.inputs[1], e.outputs[0]
    return [dim_link(ids, out, {i: i for i in range(ids.ndim)})]


def links_reshape(e: Eqn) -> list[Link]:
    x, out = e.inputs[0], e.outputs[0]
    return [(x, out, lambda p: reshape_pos(x.shape, out.shape, p),
             lambda p: reshape_pos(out.shape, x.shape, p))]


def links_permute(e: Eqn) -> list[Link]:
    x, out = e.inputs[0], e.outputs[0]
    name = e.op.name
    if name == "t":
        perm = list(reversed(range(x.ndim)))
    elif name == "transpose":
        d0, d1 = (_norm_dim(_arg(e, 1, "dim0"), x.ndim), _norm_dim(_arg(e, 2, "dim1"), x.ndim))
        perm = list(range(x.ndim))
        perm[d0], perm[d1] = perm[d1], perm[d0]
    else:
        perm = [_norm_dim(d, x.ndim) for d in _arg(e, 1, "dims")]
    return [dim_link(x, out, {src: dst for dst, src in enumerate(perm)})]


def links_unsqueeze(e: Eqn) -> list[Link]:
    x, out = e.inputs[0], e.outputs[0]
    d = _norm_dim(_arg(e, 1, "dim"), out.ndim)
    return [dim_link(x, out, {i: (i if i < d else i + 1) for i in range(x.ndim)})]


def links_squeeze(e: Eqn) -> list[Link]:
    x, out = e.inputs[0], e.outputs[0]
    kept = [i for i in range(x.ndim) if x.shape[i] != 1] if x.ndim - out.ndim == sum(s == 1 for s in x.shape) else None
    if kept is None:
        dims = _arg(e, 1, "dim")
        dims = {_norm_dim(d, x.ndim) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
        kept = [i for i in range(x.ndim) if not (i in dims and x.shape[i] == 1)]
    return [dim_link(x, out, {src: dst for dst, src in enumerate(kept)})]


def links_select(e: Eqn) -> list[Link]:
    x, out = e.inputs[0], e.outputs[0]
    d = _norm_dim(_arg(e, 1, "dim"), x.ndim)
    return [dim_link(x, out, {i: (i if i < d else i - 1) for i in range(x.ndim) if i != d})]


def links_multi_same(e: Eqn) -> list[Link]:
    """split / chunk / unbind: every output indexes the input's positions (unbind drops a dim)."""
    x = e.inputs[0]
    res = []
    for out in e.outputs:
        if out.ndim == x.ndim:
            res.append(dim_link(x, out, {i: i for i in range(x.ndim)}))
        elif out.ndim == x.ndim - 1:
            d = _norm_dim(_arg(e, 1, "dim", 0), x.ndim)
            res.append(dim_link(x, out, {i: (i if i < d else i - 1) for i in range(x.ndim) if i != d}))
    return res


def links_cat(e: Eqn) -> list[Link]:
    out = e.outputs[0]
    return [dim_link(x, out, {i: i for i in range(x.ndim)}) for x in e.inputs if x.ndim == out.ndim]


def links_attention(e: Eqn) -> list[Link]:
    q, k, v = e.inputs[:3]
    out = e.outputs[0]
    n = q.ndim
    return [dim_link(q, out, {i: i for i in range(n)}),
            dim_link(k, out, {0: 0, n - 2: n - 2}), dim_link(v, out, {0: 0, n - 2: n - 2})]


def links_loss(e: Eqn) -> list[Link]:
    x, t = e.inputs[0], e.inputs[1]
    m = {0: 0} if x.ndim >= 1 and t.ndim >= 1 else {}
    m.update({i: i - 1 for i in range(2, x.ndim)})
    res = [dim_link(x, t, m)]
    out = e.outputs[0]
    if out.ndim == t.ndim and out.ndim > 0:
        res.append(dim_link(t, out, {i: i for i in range(t.ndim)}))
    return res


def links_reduce(e: Eqn) -> list[Link]:
    x, out = e.inputs[0], e.outputs[0]
    dims = _arg(e, 1, "dim")
    if dims is None or out.ndim == 0:
        return []
    dims = {_norm_dim(d, x.ndim) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    keep = bool(_arg(e, 2, "keepdim", False))
    m, j = {}, 0
    for i in range(x.ndim):
        if i in dims:
            j += 1 if keep else 0
            continue
        m[i] = j
        j += 1
    return [dim_link(x, out, m)]


def links_stack(e: Eqn) -> list[Link]:
    """stack: every input's dims keep their meaning around the new dim."""
    out = e.outputs[0]
    d = _norm_dim(_arg(e, 1, "dim", 0), out.ndim)
    return [dim_link(x, out, {i: (i if i < d else i + 1) for i in range(x.ndim)}) for x in e.inputs]


def links_leading(e: Eqn) -> list[Link]:
    """view_as_complex / view_as_real: the leading dims are the same dims (the last pair is the number)."""
    x, out = e.inputs[0], e.outputs[0]
    n = min(x.ndim, out.ndim)
    return [dim_link(x, out, {i: i for i in range(n)})]


def links_keep_dims(e: Eqn) -> list[Link]:
    """topk / sort / argsort / kthvalue: every output indexes the input's positions along the other dims."""
    x = e.inputs[0]
    d = _norm_dim(_arg(e, 2 if e.op.name in ("topk", "kthvalue") else 1, "dim", -1), x.ndim)
    res = []
    for out in e.outputs:
        if out.ndim == x.ndim:
            res.append(dim_link(x, out, {i: i for i in range(x.ndim) if i != d}))
        elif out.ndim == x.ndim - 1:
            res.append(dim_link(x, out, {i: (i if i < d else i - 1) for i in range(x.ndim) if i != d}))
    return res


def links_addmm(e: Eqn) -> list[Link]:
    """addmm(bias, a, b) / baddbmm: a's rows are the output's rows; the bias broadcasts."""
    bias, a, b = e.inputs[:3]
    out = e.outputs[0]
    res = [dim_link(a, out, {i: i for i in range(a.ndim - 1)}),
           dim_link(b, out, {**{i: i for i in range(b.ndim - 2)}, b.ndim - 1: out.ndim - 1}),
           dim_link(bias, out, _aligned(bias, out))]
    return res


def links_einsum(e: Eqn) -> list[Link]:
    """einsum: a letter kept in the output is the same dim in every operand that has it."""
    eq = _arg(e, 0, "equation")
    if not isinstance(eq, str) or "..." in eq or "->" not in eq:
        return []
    ins, out_letters = eq.replace(" ", "").split("->")
    out = e.outputs[0]
    res = []
    for x, letters in zip(e.inputs, ins.split(",")):
        res.append(dim_link(x, out, {i: out_letters.index(c) for i, c in enumerate(letters) if c in out_letters}))
    return res


def links_scatter(e: Eqn) -> list[Link]:
    """slice_scatter / select_scatter: the base is the output; the source fills a window of one dim."""
    base, src = e.inputs[0], e.inputs[1]
    out = e.outputs[0]
    d = _norm_dim(_arg(e, 2, "dim", 0), out.ndim)
    if e.op.name == "select_scatter":
        m = {i: (i if i < d else i + 1) for i in range(src.ndim)}
    else:
        m = {i: i for i in range(src.ndim) if i != d}
    return [dim_link(base, out, {i: i for i in range(base.ndim)}), dim_link(src, out, m)]


def links_repeat_interleave(e: Eqn) -> list[Link]:
    """repeat_interleave(x, r: int, dim): each position of `dim` repeated r times in place, so a sequence
    there stays a sequence with an inner factor r; the other dims keep their meaning."""
    x, out = e.inputs[0], e.outputs[0]
    args, kwargs = e.var_args()
    r = args[1] if len(args) > 1 else kwargs.get("repeats")
    d = args[2] if len(args) > 2 else kwargs.get("dim")
    if not isinstance(r, int) or d is None or x.ndim != out.ndim:
        return links_same(e)
    d = _norm_dim(d, x.ndim)

    def fwd(p: SeqPos):
        return SeqPos(p.dim, p.outer, p.inner * r) if p.dim == d else p

    def bwd(p: SeqPos):
        if p.dim != d:
            return p
        return SeqPos(p.dim, p.outer, p.inner // r) if p.inner % r == 0 else None
    return [(x, out, fwd, bwd)]


def links_repeat(e: Eqn) -> list[Link]:
    """x.repeat(sizes): the input's dims align with the output's last ones, each tiled sizes[j] times,
    so a sequence there gains an outer factor (the tiles come first); new leading dims link nothing."""
    x, out = e.inputs[0], e.outputs[0]
    sizes = list(_arg(e, 1, "repeats"))
    off = out.ndim - x.ndim

    def fwd(p: SeqPos):
        return SeqPos(p.dim + off, p.outer * sizes[p.dim + off], p.inner)

    def bwd(p: SeqPos):
        r = sizes[p.dim]
        if p.dim < off or p.outer % r:
            return None
        return SeqPos(p.dim - off, p.outer // r, p.inner)
    return [(x, out, fwd, bwd)]


def links_index_tensor(e: Eqn) -> list[Link]:
    """x[..., idx, ...] with one index tensor (or one adjacent block): the dims before it keep their place,
    the index's dims take its place, the dims after it follow."""
    x, out = e.inputs[0], e.outputs[0]
    args, _ = e.var_args()
    indices = list(args[1]) if len(args) > 1 else []
    where = [i for i, t in enumerate(indices) if t is not None]
    if not where or where != list(range(where[0], where[-1] + 1)):
        return []
    first, idx = where[0], [indices[i] for i in where]
    n_idx = max(t.ndim for t in idx)
    m = {i: i for i in range(first)}
    m.update({i: i - len(where) + n_idx for i in range(first + len(where), x.ndim)})
    res = [dim_link(x, out, m)]
    for t in idx:
        if t.ndim == n_idx:
            res.append(dim_link(t, out, {i: first + i for i in range(t.ndim)}))
    return res


def links_grouped_rows(e: Eqn) -> list[Link]:
    """grouped_mm(mat_a, mat_b, offs): mat_a's rows are the output's rows."""
    return [dim_link(e.inputs[0], e.outputs[0], {0: 0})]


def links_scatter_dim(e: Eqn) -> list[Link]:
    """scatter / scatter_add / index_add (self, dim, index, src): every dim but `dim` indexes the same
    positions in self, index, src and the output."""
    out = e.outputs[0]
    d = _norm_dim(_arg(e, 1, "dim", 0), out.ndim)
    return [dim_link(x, out, {i: i for i in range(x.ndim) if i != d or x is e.inputs[0]})
            for x in e.inputs if x.ndim == out.ndim]


_SAME_NAMES = {"contiguous", "alias", "clone", "detach", "lift_fresh_copy", "to.dtype", "to.device",
               "to.dtype_layout", "to.other", "_to_copy.default", "type_as.default", "detach_.default",
               "dropout", "native_dropout", "expand", "expand_as", "slice", "narrow", "pad", "roll",
               "flip", "cumsum", "tril", "triu", "repeat_interleave", "softmax", "_softmax", "log_softmax",
               "_log_softmax", "layer_norm", "native_layer_norm", "rms_norm", "masked_fill.Scalar",
               "masked_fill.Tensor", "where.self", "fill_.Scalar", "zeros_like", "ones_like", "full_like",
               "empty_like", "rand_like", "randn_like", "bernoulli"}

# elementwise ops aten does not tag pointwise: the bool and integer operators masks are built with
# (`&`, `|` and chunk ids `pos // chunk`); the tagged ones (bitwise_*, logical_*) take the default
ELEMENTWISE_UNTAGGED = frozenset({"__and__.Tensor", "__and__.Scalar", "__or__.Tensor", "__or__.Scalar",
                                  "floor_divide.default", "floor_divide.Scalar"})

LINK_RULES: dict[str, Callable[[Eqn], list[Link]]] = {
    "linear": links_linear, "matmul": links_matmul, "embedding": links_embedding,
    "view": links_reshape, "reshape": links_reshape, "_unsafe_view": links_reshape, "flatten": links_reshape,
    "unflatten": links_reshape, "view_as": links_reshape, "reshape_as": links_reshape,
    "permute": links_permute, "transpose": links_permute, "t": links_permute,
    "unsqueeze": links_unsqueeze, "squeeze": links_squeeze, "select": links_select,
    "split": links_multi_same, "split_with_sizes": links_multi_same, "chunk": links_multi_same,
    "unbind": links_multi_same, "tensor_split.indices": links_multi_same, "cat": links_cat, "attention": links_attention,
    "cross_entropy": links_loss, "nll_loss": links_loss,
    "sum": links_reduce, "mean": links_reduce, "amax": links_reduce, "amin": links_reduce,
    "logsumexp": links_reduce, "prod": links_reduce, "any": links_reduce, "all": links_reduce,
    "var": links_reduce, "std": links_reduce, "argmax": links_reduce, "argmin": links_reduce,
    "stack": links_stack, "view_as_complex": links_leading, "view_as_real": links_leading,
    "topk": links_keep_dims, "sort": links_keep_dims, "argsort": links_keep_dims, "kthvalue": links_keep_dims,
    "addmm": links_addmm, "einsum": links_einsum, "slice_scatter": links_scatter, "select_scatter": links_scatter,
    "scatter": links_scatter_dim, "scatter_add": links_scatter_dim, "index_add": links_scatter_dim,
    "index": links_index_tensor, "gather": links_scatter_dim, "grouped_mm": links_grouped_rows,
}
for _n in _SAME_NAMES:
    LINK_RULES[_n] = links_index if _n in {"slice", "narrow", "pad", "cumsum", "roll", "flip"} else links_same
LINK_RULES["repeat_interleave"] = links_repeat_interleave
LINK_RULES["copy_.default"] = links_same          # dst.copy_(src): the output is dst, src broadcast into it
LINK_RULES["repeat"] = links_repeat
for _n in ELEMENTWISE_UNTAGGED:
    LINK_RULES[_n] = links_same


def links_for(e: Eqn) -> list[Link]:
    if not e.outputs or e.outputs[0].dtype is None and not e.multi:
        return []
    rule = LINK_RULES.get(e.op.name)
    if rule is None and e.op.has(Tag.ELEMENTWISE):
        rule = links_same
    if rule is None:                    # no rule names this op: ask the op itself (probe.py)
        from autosp.passes.probe import shape_links
        return [dim_link(x, out, {d: k}) for x, d, out, k in shape_links(e)]
    return rule(e)


def infer_seq_positions(graph: Graph, seeds: dict[str, SeqPos] | None = None, regions=(), *,
                        attention: bool = True) -> dict[str, SeqPos]:
    """Var name -> where its sequence is. Seeds: attention's Q/K/V/out (SDPA and head-parallel regions,
    whose inner [.., L, L] values hold two sequences and link nothing), plus user specs. `attention=False`
    spreads the given seeds alone (another dim than the sequence: the batch)."""
    pos: dict[str, SeqPos] = dict(seeds or {})
    for e in graph.eqns if attention else ():
        if e.op.name == "attention" and e.op.target is not None:
            for v in (*e.inputs[:3], e.outputs[0]):
                pos.setdefault(v.name, SeqPos(v.ndim - 2))
    inside: set[int] = set()
    for r in regions:
        inside |= r.eqns
        for v in (r.q, r.k, r.v, r.out):
            pos.setdefault(v.name, SeqPos(v.ndim - 2))
    adj: dict[str, list[tuple[Var, Map, bool]]] = defaultdict(list)
    for k, e in enumerate(graph.eqns):
        if k in inside:
            continue
        for link in links_for(e):
            a, b, fwd, bwd = link
            adj[a.name].append((b, fwd, isinstance(link, WeakLink)))
            adj[b.name].append((a, bwd, False))
    work, deferred = list(pos), []
    while work or deferred:
        if not work:                        # every ordinary link followed: the weak ones, in order
            other, q = deferred.pop(0)
            if other.name not in pos:
                pos[other.name] = q
                work.append(other.name)
            continue
        name = work.pop()
        p = pos[name]
        for other, f, weak in adj.get(name, ()):
            q = f(p)
            if q is None or other.name in pos:
                continue
            if not (0 <= q.dim < other.ndim) or other.shape[q.dim] % (q.outer * q.inner) or q.length(other) <= 1:
                continue
            if weak:
                deferred.append((other, q))
                continue
            pos[other.name] = q
            work.append(other.name)
    return pos


def token_id_seeds(graph: Graph) -> dict[str, SeqPos]:
    """Without attention to seed from: the token ids. An integer graph input of shape [b, s] or [s] that
    reaches an embedding's indices (through casts, copies and same-shape views) is the ids, its last dim
    the sequence. Labels and position ids of the same shape then follow through the ordinary links."""
    producer = {o.name: e for e in graph.eqns for o in e.outputs}
    inputs = {v.name: v for v in graph.inputs}
    seeds = {}
    for e in graph.eqns:
        if e.op.name != "embedding" or len(e.inputs) < 2:
            continue
        v = e.inputs[1]
        while v.name not in inputs:
            p = producer.get(v.name)
            srcs = [x for x in p.inputs if x.dtype is not None] if p is not None else []
            if len(srcs) != 1 or srcs[0].shape != v.shape or p.op.name not in _ID_PATH:
                break
            v = srcs[0]
        ids = inputs.get(v.name)
        if (ids is not None and ids.dtype is not None and not ids.dtype.is_floating_point
                and not ids.dtype.is_complex and ids.dtype != torch.bool and ids.ndim in (1, 2) and ids.shape[-1] > 1):
            seeds[ids.name] = SeqPos(ids.ndim - 1)
    return seeds


# what may stand between the token ids and the embedding: the same values, perhaps another dtype
_ID_PATH = {"to.dtype", "to.device", "to.dtype_layout", "to.other", "_to_copy.default", "type_as.default",
            "clone", "contiguous", "alias", "detach", "lift_fresh_copy", "view", "reshape", "_unsafe_view"}


def attention_length(graph: Graph, regions=()) -> int:
    """The sequence length attention sees (the same for every attention op, else an error)."""
    lengths = {}
    for r in regions:
        lengths[r.q.shape[-2]] = r
    for e in graph.eqns:
        if e.op.name == "attention":
            q, k = e.inputs[0], e.inputs[1]
            if q.shape[-2] != k.shape[-2]:
                raise ShardError(
                    f"attention at {e.source}: queries of length {q.shape[-2]} attend keys of length "
                    f"{k.shape[-2]} (cross-attention or a KV cache). autosp shards self-attention only. "
                    "Fix: disable the cache (use_cache=False) or pass in_specs for a self-attention model.")
            lengths[q.shape[-2]] = e
    if len(lengths) > 1:
        raise ShardError(f"attention runs at several sequence lengths {sorted(lengths)}; autosp shards one. "
                         "Fix: run one sequence length per call.")
    return next(iter(lengths)) if lengths else 0

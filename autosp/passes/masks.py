"""Attention masks as functions: an s x s mask built by broadcasting per-query and per-key vectors,
read back out of the trace as an expression over those vectors, so that it is never built.

    pos_q = position_ids[b, q]                    # [B, 1, L, 1]   a per-query leaf
    pos_k = position_ids[b, k]                    # [B, 1, 1, L]   a per-key leaf
    m = (pos_k <= pos_q) & (doc_q == doc_k)       # [B, 1, L, L]   pairwise: never materialised
    sdpa(q, k, v, attn_mask=m)

becomes `masked_attention(q, k, v, [pos_q, pos_k, doc_q, doc_k], "(x1[k] <= x0[q]) & (x2[q] == x3[k])")`
(the grammar is autosp/kernels/maskfn.py). A value is *pairwise* when its last two dims are both
the attention length L; every pairwise value of the mask must come from elementwise ops, casts,
broadcasting views or constants (tril of ones, a constant fill) over *leaves*: values whose last
two dims are (L, 1), (1, L) or (1, 1), with no head dim (chunk ids, `(pos - left_pad) // chunk`, stay
arithmetic over the positions and a per-row scalar). Leaves are O(B * L): the sharding pass
computes them replicated, and the kernels evaluate the expression block by block. Anything else
(a mask read from the input, gathered, or per head) returns None, and the mask stays a tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autosp.ir.core import Eqn, Graph, Var
from autosp.ir.ops import Tag

_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_BIN = {"__and__": "&", "bitwise_and": "&", "logical_and": "&", "__or__": "|", "bitwise_or": "|",
        "logical_or": "|", "add": "+", "sub": "-", "mul": "*", "floor_divide": "//"}
_NOT = {"bitwise_not", "logical_not"}
_SAME = {"expand", "unsqueeze", "squeeze", "view", "reshape", "_unsafe_view", "alias", "clone", "contiguous",
         "detach", "lift_fresh_copy", "expand_as", "view_as", "reshape_as"}
_CAST = {"to", "_to_copy", "type_as"}


@dataclass(frozen=True)
class MaskFn:
    """A mask as `expr` (maskfn grammar) over `leaves`: global Vars, each with its side ("q": [.., L, 1],
    "k": [.., 1, L], "": [.., 1, 1]) and batch (1 or B) once viewed as [batch, Lq or 1, Lk or 1]."""
    expr: str
    leaves: tuple[Var, ...]
    sides: tuple[str, ...]

    def __str__(self) -> str:
        return self.expr


def _packet(e: Eqn) -> str:
    t = e.op.target
    name = getattr(t, "_schema", None)
    return name.name.split("::")[-1] if name is not None else e.op.name


def _literal(x) -> str | None:
    if isinstance(x, bool):
        return repr(x)
    if isinstance(x, int):
        return repr(x)
    if isinstance(x, float):
        if math.isinf(x):
            return "inf" if x > 0 else "(-inf)"
        return repr(x) if not math.isnan(x) else None
    return None


class _Builder:
    def __init__(self, graph: Graph, length: int, batch: int, const_value):
        self.length, self.batch = length, batch
        self.producer = {o.name: e for e in graph.eqns for o in e.outputs}
        self.const_value = const_value          # old Var -> its real value when input-free, else None
        self.leaves: list[Var] = []
        self.sides: list[str] = []
        self.memo: dict[str, str] = {}
        self._same_as: dict = {}

    def trailing(self, v: Var) -> tuple[int, int]:
        shape = (1, 1) + tuple(v.shape)
        return shape[-2], shape[-1]

    def pairwise(self, v: Var) -> bool:
        a, b = self.trailing(v)
        return a == self.length and b == self.length and self.length > 1

    def expr(self, v) -> str | None:
        if not isinstance(v, Var):
            return _literal(v)
        if v.name in self.memo:
            return self.memo[v.name]
        out = self._pair(v) if self.pairwise(v) else self._leaf(v)
        if out is not None:
            self.memo[v.name] = out
        return out

    def _leaf(self, v: Var) -> str | None:
        a, b = self.trailing(v)
        if a not in (1, self.length) or b not in (1, self.length) or (a == b == self.length):
            return None
        wide = [d for d in v.shape[:-2] if d != 1]      # at most the batch: a head dim stays a tensor
        if len(wide) > 1 or (wide and wide[0] != self.batch):
            return None
        if a == b == 1:
            c = self.const_value(v)
            if c is not None and c.numel() == 1:
                lit = _literal(c.item())
                if lit is not None:
                    return lit
        side = "q" if a == self.length else "k" if b == self.length else ""
        if side:
            shown = self._attempt(lambda: self._chunk_ids(v))
            if shown is not None:
                return shown
            c = self.const_value(v)
            if c is not None and c.dtype in (torch.int64, torch.int32):
                ar = torch.arange(self.length, dtype=c.dtype).view((self.length, 1) if side == "q" else (1, -1))
                shift = c.reshape(c.shape[:-2].numel() if c.ndim > 2 else 1, a, b) - ar
                if bool((shift == shift.reshape(-1)[0]).all()):   # the position itself, or shifted (windows)
                    d = int(shift.reshape(-1)[0])
                    return side if d == 0 else f"({side} {'+' if d > 0 else '-'} {abs(d)})"
        same = self._same_as.get(self._key(v))       # the same value computed twice (once per side of HF's mask)
        if same is not None and self.sides[same] == side:
            i = same
        else:
            self.leaves.append(v)
            self.sides.append(side)
            i = len(self.leaves) - 1
            self._same_as.setdefault(self._key(v), i)
        return f"x{i}[{side}]" if side else f"x{i}"

    def _key(self, v: Var):
        e = self.producer.get(v.name)
        if e is None or e.op.has(Tag.RANDOM):
            return v.name
        return (e.op.target, repr(e.var_args()), v.shape, v.dtype)

    def _chunk_ids(self, v: Var) -> str | None:
        """A per-query or per-key vector kept as arithmetic where it is chunk ids (Llama 4's chunked
        attention: `(pos - left_padding) // chunk`), so the mask reads `((k - x0) // 8) == ((q - x0) // 8)`
        rather than two opaque leaves: a division by a literal, of a position shifted by a per-batch scalar."""
        e = self.producer.get(v.name)
        if e is None:
            return None
        name, (args, kwargs) = _packet(e), e.var_args()
        if name == "floor_divide":
            num, den = args[:2]
            if not isinstance(den, (int, float)) or isinstance(den, bool) or not den:
                return None
            x = self.expr(num)
            return None if x is None else f"({x} // {_literal(den)})"
        if name in ("add", "sub") and self.const_value(v) is None and len(args) == 2 and kwargs.get("alpha", 1) == 1:
            x, y = args
            if not (isinstance(x, Var) and isinstance(y, Var) and self.trailing(x) != (1, 1)
                    and self.trailing(y) == (1, 1)):
                return None                             # a vector shifted by a per-batch scalar, nothing else
            x, y = self.expr(x), self.expr(y)
            return None if x is None or y is None else f"({x} {_BIN[name]} {y})"
        return None

    def _attempt(self, build):
        """build() or None; a failed attempt leaves no leaves behind."""
        n, memo, same = len(self.leaves), dict(self.memo), dict(self._same_as)
        out = build()
        if out is None:
            del self.leaves[n:], self.sides[n:]
            self.memo, self._same_as = memo, same
        return out

    def _constant_pair(self, v: Var) -> str | None:
        c = self.const_value(v)
        if c is None:
            return None
        flat = c.reshape(-1, self.length, self.length)
        first = flat.reshape(-1)[0].item()
        if bool((flat == first).all()):
            return _literal(first)
        from autosp.passes.shard_rules import is_causal_mask
        if not bool((flat == flat[:1]).all()) or not is_causal_mask(flat[0]):
            return None
        if c.dtype == torch.bool:
            return "(k <= q)"
        return "where(k <= q, 0.0, (-inf))"

    def _pair(self, v: Var) -> str | None:
        e = self.producer.get(v.name)
        if e is None:
            return None                                 # a graph input: a mask tensor the user passed
        const = self._constant_pair(v)
        if const is not None:
            return const
        name = _packet(e)
        args, kwargs = e.var_args()
        if name in _CMP or name in _BIN:
            if len(args) < 2 or kwargs.get("alpha", 1) != 1 or (len(args) > 2 and args[2] != 1):
                return None
            x, y = self.expr(args[0]), self.expr(args[1])
            if x is None or y is None:
                return None
            op = _CMP.get(name) or _BIN[name]
            if name.startswith("logical") and any(isinstance(a, Var) and a.dtype != torch.bool for a in args[:2]):
                return None
            if op in "&|" and v.dtype == torch.bool:     # HF's masks start from `True & ...`
                unit, zero = ("True", "False") if op == "&" else ("False", "True")
                if zero in (x, y):
                    return zero
                if x == unit or y == unit:
                    return y if x == unit else x
            return f"({x} {op} {y})"
        if name in _NOT:
            if e.inputs[0].dtype != torch.bool:
                return None
            x = self.expr(args[0])
            return None if x is None else f"(~{x})"
        if name == "neg":
            x = self.expr(args[0])
            return None if x is None else f"(-{x})"
        if name == "rsub":
            x, y = self.expr(args[0]), self.expr(args[1])
            return None if x is None or y is None or (len(args) > 2 and args[2] != 1) else f"({y} - {x})"
        if name == "where":
            c, x, y = (self.expr(a) for a in args[:3])
            return None if None in (c, x, y) else f"where({c}, {x}, {y})"
        if name == "masked_fill":
            x, m, val = (self.expr(a) for a in args[:3])
            return None if None in (x, m, val) else f"where({m}, {val}, {x})"
        if name in _SAME:                               # broadcasting views: the function is unchanged
            return self.expr(e.inputs[0])
        if name in _CAST:
            x = self.expr(e.inputs[0])
            if x is None:
                return None
            return x if v.dtype == e.inputs[0].dtype else f'cast({x}, "{str(v.dtype).removeprefix("torch.")}")'
        return None


def mask_function(graph: Graph, mask: Var, length: int, batch: int, const_value) -> MaskFn | None:
    """The mask of an attention call as a function of its leaves, or None (see the module docstring).

    `const_value(var)` gives the real value of an input-free Var (or None): constant pieces (tril of
    ones, a fill, position aranges) become literals and the names `q` / `k`."""
    if mask.dtype is None or mask.ndim < 2 or mask.shape[-2:] != (length, length):
        return None
    if mask.ndim >= 3 and mask.shape[-3] != 1:
        return None
    if mask.ndim >= 4 and mask.shape[-4] not in (1, batch):
        return None
    b = _Builder(graph, length, batch, const_value)
    expr = b.expr(mask)
    if expr is None:
        return None
    return MaskFn(expr, tuple(b.leaves), tuple(b.sides))

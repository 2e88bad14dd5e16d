"""Attention masks as functions: a small expression language over positions and leaf vectors.

A mask is a Python-expression string such as

    (k <= q) & (x0[q] == x0[k]) & (q - k < 4096)

over these names:
  q, k     the global query / key position (int64; q varies along rows, k along columns);
  xN[q]    leaf N read per query, xN[k] leaf N read per key: leaves[N] is a vector of the
           sequence, [B_i, L, 1] (canonical for xN[q]) or [B_i, 1, L] (canonical for xN[k]);
           one leaf may be read both ways, as in `x0[q] == x0[k]`;
  xN       leaf N with neither dim: leaves[N] is [B_i, 1, 1];
with B_i either 1 or the batch. Literals: ints, floats (Python repr), True, False, inf.
Operators: == != < <= > >= (one per comparison: chains are refused, since `a <= b & c == d`
parses as a chain), & | ~ (on bools), + - * // and unary - (on numbers; // floors, as torch's
floor_divide: chunk ids `q // 8 == k // 8`; a literal 0 divisor is refused), parentheses.
Functions: where(cond, a, b), cast(x, "float32") (any torch dtype name).

The value is a bool (True: the query may attend the key) or a float (added to the scaled
scores, -inf blocks): SDPA's attn_mask, broadcast over heads. `mask_block` evaluates it on one
block of (query, key) pairs; only `dense_mask` (tests, references) builds the whole L x L.
Ints stay int64 throughout, so positions compare exactly at any length.

The string is the mask's printed form (`str(parse(e)) == e`); `parse` caches by string.
"""
from __future__ import annotations

import ast
import functools
import operator
import re
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from autosp.errors import AutospError

ALLOWED = ("q, k; leaves xN[q], xN[k], xN; literals int, float, True, False, inf; "
           "== != < <= > >= & | ~ + - * // and unary -; parentheses; where(cond, a, b), cast(x, \"dtype\")")

_LEAF = re.compile(r"x(0|[1-9][0-9]*)\Z")
_KINDS = ("bool", "int", "float")      # promotion order, as torch's categories
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge}
_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}
_LOGIC = {ast.BitAnd: operator.and_, ast.BitOr: operator.or_}
_INT64 = (-2 ** 63, 2 ** 63 - 1)


@dataclass(frozen=True, slots=True)
class Block:
    """Where a block of the mask is evaluated: rows i0..i1 (queries), columns j0..j1 (keys)."""
    leaves: Sequence[torch.Tensor]
    i0: int
    i1: int
    j0: int
    j1: int
    q: torch.Tensor     # [1, i1 - i0, 1] int64
    k: torch.Tensor     # [1, 1, j1 - j0] int64


# A compiled node: how to evaluate it on a block, and its kind given the leaves' kinds.
Eval = Callable[[Block], object]
Kind = Callable[[Sequence[str]], str]


@dataclass(frozen=True, slots=True)
class MaskFn:
    """A parsed mask: its expression, the leaves it reads, and its evaluator."""
    expr: str
    uses: tuple[tuple[int, str], ...]        # (leaf index, "q" | "k" | "scalar"), sorted
    evaluate: Eval = field(repr=False, compare=False)
    kind: Kind = field(repr=False, compare=False)

    def __str__(self) -> str:
        return self.expr

    def roles(self, index: int) -> set[str]:
        return {role for i, role in self.uses if i == index}


def _error(expr: str, node: ast.AST, why: str) -> AutospError:
    piece = ast.get_source_segment(expr, node) or ast.unparse(node)
    return AutospError(f"mask {expr!r}: {piece!r} {why}; a mask may use: {ALLOWED}")


def _kind_of(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


def _promote(*kinds: str) -> str:
    return max(kinds, key=_KINDS.index)


def _read_leaf(leaf: torch.Tensor, lo: int, hi: int, axis: int) -> torch.Tensor:
    # A vector leaf is [B, L, 1] or [B, 1, L]; read positions lo..hi and lay them along `axis`.
    own = 1 if leaf.shape[2] == 1 else 2
    piece = leaf[:, lo:hi, :] if own == 1 else leaf[:, :, lo:hi]
    return piece if own == axis else piece.transpose(1, 2)


class _Compiler:
    """AST node -> (evaluator, kind function); refuses anything outside the grammar."""

    def __init__(self, expr: str):
        self.expr = expr
        self.uses: set[tuple[int, str]] = set()

    def fail(self, node: ast.AST, why: str) -> AutospError:
        return _error(self.expr, node, why)

    def kind_error(self, node: ast.AST, why: str) -> AutospError:
        piece = ast.get_source_segment(self.expr, node) or ast.unparse(node)
        return AutospError(f"mask {self.expr!r}: {piece!r}: {why}")

    def leaf_index(self, name: str) -> Optional[int]:
        m = _LEAF.match(name)
        return int(m.group(1)) if m else None

    def compile(self, node: ast.AST) -> tuple[Eval, Kind]:
        method = getattr(self, "c_" + type(node).__name__, None)
        if method is None:
            raise self.fail(node, self._why_not(node))
        return method(node)

    def _why_not(self, node: ast.AST) -> str:
        if isinstance(node, ast.BoolOp):
            return "uses and/or, which tensors do not take: write & | with parenthesised comparisons"
        if isinstance(node, ast.Attribute):
            return "is an attribute access, which masks do not allow"
        if isinstance(node, ast.Call):
            return "calls a function other than where(cond, a, b) and cast(x, \"dtype\")"
        return f"is a {type(node).__name__}, not part of the mask language"

    def c_Constant(self, node: ast.Constant):
        value = node.value
        if isinstance(value, bool):
            kind = "bool"
        elif isinstance(value, int):
            if not _INT64[0] <= value <= _INT64[1]:
                raise self.fail(node, "is outside int64")
            kind = "int"
        elif isinstance(value, float):
            kind = "float"
        else:
            raise self.fail(node, f"is a {type(value).__name__} literal; only int, float and bool literals "
                                  f"(and a dtype name inside cast) are allowed")
        return (lambda blk: value), (lambda lk: kind)

    def c_Name(self, node: ast.Name):
        name = node.id
        if name == "q":
            return (lambda blk: blk.q), (lambda lk: "int")
        if name == "k":
            return (lambda blk: blk.k), (lambda lk: "int")
        if name == "inf":
            return (lambda blk: float("inf")), (lambda lk: "float")
        index = self.leaf_index(name)
        if index is None:
            raise self.fail(node, "is an unknown name (leaves are x0, x1, ...)")
        self.uses.add((index, "scalar"))
        return (lambda blk: blk.leaves[index]), (lambda lk: lk[index])

    def c_Subscript(self, node: ast.Subscript):
        base, sub = node.value, node.slice
        index = self.leaf_index(base.id) if isinstance(base, ast.Name) else None
        if index is None or not (isinstance(sub, ast.Name) and sub.id in ("q", "k")):
            raise self.fail(node, "is not a leaf read: index a leaf xN by q or k, as x0[q]")
        if sub.id == "q":
            self.uses.add((index, "q"))
            return (lambda blk: _read_leaf(blk.leaves[index], blk.i0, blk.i1, 1)), (lambda lk: lk[index])
        self.uses.add((index, "k"))
        return (lambda blk: _read_leaf(blk.leaves[index], blk.j0, blk.j1, 2)), (lambda lk: lk[index])

    def c_Compare(self, node: ast.Compare):
        if len(node.ops) != 1:
            raise self.fail(node, "is a chained comparison (often `a <= b & c == d`, where & binds first); "
                                  "write (a <= b) & (c == d)")
        fn = _COMPARE.get(type(node.ops[0]))
        if fn is None:
            raise self.fail(node, "compares with is/in; use == != < <= > >=")
        (ea, ka), (eb, kb) = self.compile(node.left), self.compile(node.comparators[0])

        def kind(lk):
            ka(lk), kb(lk)          # their own errors, if any
            return "bool"
        return (lambda blk: fn(ea(blk), eb(blk))), kind

    def c_BinOp(self, node: ast.BinOp):
        op = type(node.op)
        (ea, ka), (eb, kb) = self.compile(node.left), self.compile(node.right)
        if op in _LOGIC:
            fn = _LOGIC[op]

            def kind(lk):
                kinds = (ka(lk), kb(lk))
                if kinds != ("bool", "bool"):
                    raise self.kind_error(node, f"& and | take bools, got {kinds[0]} and {kinds[1]}; "
                                                f"parenthesise the comparisons ((a < b) & (c == d)) or compare first")
                return "bool"
            return (lambda blk: fn(ea(blk), eb(blk))), kind
        if op in _ARITH:
            fn = _ARITH[op]
            if op is ast.FloorDiv and isinstance(node.right, ast.Constant) and node.right.value == 0:
                raise self.fail(node, "divides by the literal 0")

            def kind(lk):
                kinds = (ka(lk), kb(lk))
                if "bool" in kinds:
                    raise self.kind_error(node, f"arithmetic on a bool ({kinds[0]}, {kinds[1]}); "
                                                f"use where(cond, a, b) or cast(x, \"int64\")")
                return _promote(*kinds)
            return (lambda blk: fn(ea(blk), eb(blk))), kind
        raise self.fail(node, f"uses the operator {type(node.op).__name__}, which masks do not allow")

    def c_UnaryOp(self, node: ast.UnaryOp):
        ea, ka = self.compile(node.operand)
        if isinstance(node.op, ast.USub):
            def kind(lk):
                if ka(lk) == "bool":
                    raise self.kind_error(node, "negates a bool; use ~ for not")
                return ka(lk)
            return (lambda blk: -ea(blk)), kind
        if isinstance(node.op, ast.Invert):
            def kind(lk):
                if ka(lk) != "bool":
                    raise self.kind_error(node, f"~ takes a bool, got {ka(lk)}")
                return "bool"

            def ev(blk):
                x = ea(blk)
                return (not x) if isinstance(x, bool) else ~x   # ~True is -2 in Python
            return ev, kind
        raise self.fail(node, "uses a unary operator other than - and ~ (not: write ~)")

    def c_Call(self, node: ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name not in ("where", "cast"):
            raise self.fail(node, self._why_not(node))
        arity = 3 if name == "where" else 2
        if node.keywords or len(node.args) != arity:
            raise self.fail(node, f"calls {name} with the wrong arguments: it takes {arity} positional ones")
        if name == "cast":
            return self._cast(node)
        (ec, kc), (ea, ka), (eb, kb) = (self.compile(a) for a in node.args)

        def kind(lk):
            if kc(lk) != "bool":
                raise self.kind_error(node, f"where's condition must be a bool, got {kc(lk)}")
            return _promote(ka(lk), kb(lk))

        def ev(blk):
            c, a, b = ec(blk), ea(blk), eb(blk)
            if not isinstance(c, torch.Tensor):
                return a if c else b
            return torch.where(c, a, b)
        return ev, kind

    def _cast(self, node: ast.Call):
        target = node.args[1]
        dtype = getattr(torch, target.value, None) if (isinstance(target, ast.Constant)
                                                        and isinstance(target.value, str)) else None
        if not isinstance(dtype, torch.dtype) or dtype.is_complex:
            raise self.fail(target, "is not a torch dtype name (as \"float32\", \"int64\", \"bool\")")
        ex, kx = self.compile(node.args[0])
        kind_out = _kind_of(dtype)

        def ev(blk):
            x = ex(blk)
            return x.to(dtype) if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=dtype)

        def kind(lk):
            kx(lk)
            return kind_out
        return ev, kind


@functools.lru_cache(maxsize=512)
def _parse(expr: str) -> MaskFn:
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise AutospError(f"mask {expr!r} is not a Python expression ({e.msg}); a mask may use: {ALLOWED}") from None
    comp = _Compiler(expr.strip())
    ev, kind = comp.compile(tree.body)
    return MaskFn(expr, tuple(sorted(comp.uses)), ev, kind)


def parse(expr) -> MaskFn:
    """The compiled mask of an expression string (cached); a MaskFn passes through."""
    if isinstance(expr, MaskFn):
        return expr
    if not isinstance(expr, str):
        raise AutospError(f"a mask must be an expression string, got {type(expr).__name__}; a mask may use: {ALLOWED}")
    return _parse(expr)


def check_leaves(expr, leaves: Sequence[torch.Tensor], seq_len: int, batch: int,
                 device: Optional[torch.device] = None, op: Optional[str] = None) -> str:
    """Raise AutospError unless `leaves` fit the mask's use of them at this length and batch;
    return the mask's kind, "bool" or "float". Reads shapes and dtypes only, never values
    (so it records nothing when traced). `op` prefixes every message."""
    try:
        return _check_leaves(expr, leaves, seq_len, batch, device)
    except AutospError as e:
        if op is None:
            raise
        raise AutospError(f"{op}: {e}") from None


def _check_leaves(expr, leaves, seq_len, batch, device) -> str:
    fn = parse(expr)
    where = f"mask {fn.expr!r}"
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in leaves]
    bs = "1" if batch == 1 else f"1 or {batch}"       # a leaf's batch dim
    for index, _ in fn.uses:
        if index >= len(leaves):
            raise AutospError(f"{where} reads x{index} but {len(leaves)} leaves were given ({shapes}); pass "
                              f"one tensor per leaf x0, x1, ...")
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise AutospError(f"{where}: leaf x{index} must be a Tensor, got {type(leaf).__name__}")
        if device is not None and leaf.device != device:
            raise AutospError(f"{where}: leaf x{index} is on {leaf.device}, the queries on {device}; move it "
                              f"with .to({str(device)!r})")
        if leaf.dtype.is_complex:
            raise AutospError(f"{where}: leaf x{index} is {leaf.dtype}; leaves are bool, int or float")
        roles = fn.roles(index)
        if not roles:
            continue
        vector = roles & {"q", "k"}
        if vector and "scalar" in roles:
            raise AutospError(f"{where}: x{index} is read both bare and as x{index}[q]/x{index}[k]; pass "
                              f"two leaves")
        if vector:
            ok = (leaf.dim() == 3 and leaf.shape[0] in (1, batch)
                  and tuple(leaf.shape[1:]) in ((seq_len, 1), (1, seq_len)))
            want = (f"[{bs}, {seq_len}, 1]" if vector == {"q"} else f"[{bs}, 1, {seq_len}]"
                    if vector == {"k"} else f"[{bs}, {seq_len}, 1] or [{bs}, 1, {seq_len}]")
            use = " and ".join(f"x{index}[{r}]" for r in sorted(vector, reverse=True))
        else:
            ok = leaf.dim() == 3 and leaf.shape[0] in (1, batch) and tuple(leaf.shape[1:]) == (1, 1)
            want, use = f"[{bs}, 1, 1]", f"x{index}"
        if not ok:
            raise AutospError(f"{where}: leaf x{index} has shape {tuple(leaf.shape)} but {use} needs {want} "
                              f"(batch {batch}, length {seq_len}); reshape it, e.g. ids[:, :, None] for x{index}[q], "
                              f"ids[:, None, :] for x{index}[k]")
    kind = fn.kind([_kind_of(t.dtype) for t in leaves])
    if kind not in ("bool", "float"):
        raise AutospError(f"{where} is {kind}-valued; a mask is bool (True: attend) or float (added to the "
                          f"scores); compare it, e.g. ({fn.expr}) != 0")
    return kind


def mask_block(expr, leaves: Sequence[torch.Tensor], i0: int, i1: int, j0: int, j1: int,
               device: Optional[torch.device] = None, expand: bool = True) -> torch.Tensor:
    """The mask on queries i0..i1 and keys j0..j1: [B or 1, i1 - i0, j1 - j0], bool or float
    (an expanded view where the mask does not vary along a dim). With expand=False the dims it
    does not vary along stay 1 (a kernel then reduces and broadcasts the smaller tensor)."""
    fn = parse(expr)
    if device is None:
        device = leaves[0].device if len(leaves) else torch.device("cpu")
    q = torch.arange(i0, i1, dtype=torch.int64, device=device).view(1, -1, 1)
    k = torch.arange(j0, j1, dtype=torch.int64, device=device).view(1, 1, -1)
    out = fn.evaluate(Block(leaves, i0, i1, j0, j1, q, k))
    if not isinstance(out, torch.Tensor):
        out = torch.tensor(out, device=device)
    out = out.reshape((1,) * (3 - out.dim()) + tuple(out.shape))
    return out.expand(out.shape[0], i1 - i0, j1 - j0) if expand else out


def dense_mask(expr, leaves: Sequence[torch.Tensor], seq_len: int,
               device: Optional[torch.device] = None) -> torch.Tensor:
    """The whole [B or 1, L, L] mask: for tests and references only (it is L x L)."""
    return mask_block(expr, leaves, 0, seq_len, 0, seq_len, device).contiguous()

"""A mask as a conjunction of comparison terms: the form the flash kernels evaluate tile by tile.

    (k <= q) & (x0[q] == x1[k]) & (q - k < 4096) & x2[k]

is recognised as four terms, each `A op B` with A a *query vector* (one int64 per query position,
built from q, leaves read xN[q], scalar leaves xN and int literals) and B a *key vector* (from k and
leaves read xN[k]), op one of <=, ==, !=:

    -q         <= -k          k <= q
    x0[q]      == x1[k]
    q - 4095   <= k           q - k < 4096
    where(True, 0, 2) <= where(x2[k], 0, -1)      the gate: every one-sided conjunct

How a conjunct becomes a term: `L op R` with L - R an integer sum whose query-side and key-side parts
separate (q - k < W, x1[k] > x2[q], x0[q] - x0[k] == 0) is rewritten as A op' B with op' in
{<=, ==, !=} (ints: a < b is a + 1 <= b; a >= b is -a <= -b). Conjuncts that read one side only
(key padding x0[k], a bool leaf x0, `x0[q] > 2`) are ANDed into one gate term: a query-side condition
G_q and a key-side G_k as where(G_q, 0, 2) <= where(G_k, 0, -1), true exactly when both hold. At most
MAX_TERMS terms (op codes are kernel constexprs). Anything else (a float mask, `|` across q and k, a
product of q and k, a comparison of floats) is not of this form: `recognise` returns None and
masked_attention keeps its blockwise torch path.

Why this form: a tile of queries x keys is empty when some term fails for every pair, and needs no
mask arithmetic when every term holds for every pair, both decided from the per-tile min and max
of A and B (an interval test: A == B is impossible when max A < min B, ...). For packed documents
(ids nondecreasing along the sequence) the tiles that survive are those meeting a document's
square, so attention's cost follows sum(doc_len^2), not s^2 (flash.py's kernels say how they scan).

Per call, `TileMask.build` evaluates the vectors once (O(batch * L), through maskfn's evaluator)
and `bounds(tile_q, tile_k)` their per-tile min/max for one kernel's tile sizes.
"""
from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from autosp.errors import AutospError
from autosp.kernels.maskfn import _kind_of, mask_block, parse

MAX_TERMS = 4
OPS = ("<=", "==", "!=")          # kernel op codes 0, 1, 2

# An integer sum: {atom: coefficient}, atom "" the constant 1. Atoms are maskfn expressions that
# read one side only ("q", "x3[k]", "x0", "cast(x1[q], \"int64\")").
Affine = dict


@dataclass(frozen=True, slots=True)
class Term:
    """query `op` key: both maskfn expressions, the query one over q-side names, the key one over k-side ones."""
    query: str
    op: str
    key: str

    def __str__(self) -> str:
        return f"{self.query} {self.op} {self.key}"


@dataclass(frozen=True, slots=True)
class Terms:
    """A mask recognised as a conjunction of terms. `causal`: some term implies k <= q, so no query
    attends a key after it (the kernels never scan tiles above the diagonal)."""
    mask: str
    terms: tuple[Term, ...]
    causal: bool

    @property
    def ops(self) -> int:
        """The op codes as one kernel constexpr: term t's code in bits 2t, 2t + 1."""
        return sum(OPS.index(t.op) << (2 * i) for i, t in enumerate(self.terms))

    def __str__(self) -> str:
        return " & ".join(f"({t})" for t in self.terms)

    def problem(self, leaf_kinds: Sequence[str]) -> Optional[str]:
        """Why these leaf kinds ("bool", "int", "float", by leaf index) do not fit the terms, or None:
        each side must be an integer (bools count as 0/1 only in == and !=)."""
        for t in self.terms:
            for side in (t.query, t.key):
                try:
                    kind = parse(side).kind(leaf_kinds)
                except AutospError as e:        # a bool leaf in the arithmetic of a rewritten comparison
                    return f"the term {t} does not type-check ({e})"
                if kind == "float" or (kind == "bool" and t.op == "<="):
                    return f"the term {t} compares {kind} values; the kernel compares integers exactly"
        return None


def recognise(mask) -> Optional[Terms]:
    """The mask as terms, or None when it is not a conjunction of the kernel's form (module docstring)."""
    return _recognise(str(parse(mask)))


def why_not(mask, leaf_kinds: Optional[Sequence[str]] = None) -> Optional[str]:
    """Why the flash kernels cannot evaluate this mask (a sentence), or None when they can.
    Without leaf_kinds the leaves' dtypes are not checked."""
    terms = recognise(mask)
    if terms is None:
        return (f"mask {str(parse(mask))!r} is not a conjunction (&) of at most {MAX_TERMS} comparisons between "
                f"a query-side and a key-side integer (q, k, xN[q], xN[k] with + - and int factors) plus "
                f"one-sided conditions")
    return None if leaf_kinds is None else terms.problem(leaf_kinds)


@functools.lru_cache(maxsize=256)
def _recognise(expr: str) -> Optional[Terms]:
    conjuncts: list[ast.AST] = []
    _split_and(ast.parse(expr, mode="eval").body, conjuncts)
    terms, gates = [], {"q": [], "k": []}
    causal = False
    for node in conjuncts:
        sides = _sides(node)
        if isinstance(node, ast.Constant) and node.value is True:
            continue
        if sides <= {"q"} or sides == {"k"}:
            if not _boolean(node):
                return None                         # a float mask, or where(...) of anything
            gates["k" if sides == {"k"} else "q"].append(_paren(ast.unparse(node)))
            continue
        found = _comparison(node)
        if found is None:
            return None
        a, op, b = found
        causal |= _implies_causal(a, op, b)
        terms.append(Term(_format(a), op, _format(b)))
    if gates["q"] or gates["k"]:
        gq, gk = " & ".join(gates["q"]), " & ".join(gates["k"])
        terms.append(Term(f"where({gq}, 0, 2)" if gq else "0", "<=", f"where({gk}, 0, -1)" if gk else "0"))
    if not terms or len(terms) > MAX_TERMS:
        return None
    return Terms(expr, tuple(terms), causal)


def _split_and(node: ast.AST, out: list) -> None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitAnd):
        _split_and(node.left, out)
        _split_and(node.right, out)
    else:
        out.append(node)


def _boolean(node: ast.AST) -> bool:
    """Whether a one-sided conjunct is a condition by its form: a comparison, & | ~, a bool literal,
    a leaf (its dtype is checked by Terms.problem) or a cast to bool."""
    if isinstance(node, (ast.Compare, ast.Name, ast.Subscript)):
        return True
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, (ast.BitAnd, ast.BitOr))
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, ast.Invert)
    if isinstance(node, ast.Constant):
        return isinstance(node.value, bool)
    return (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "cast"
            and getattr(node.args[1], "value", None) == "bool")


def _sides(node: ast.AST) -> set[str]:
    """Which of q and k a node reads (scalar leaves and literals read neither)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id in ("q", "k"):
            out.add(n.id)
    return out


_FLIP = {ast.Lt: ast.GtE, ast.LtE: ast.Gt, ast.Gt: ast.LtE, ast.GtE: ast.Lt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}


def _comparison(node: ast.AST):
    """(A, op, B) affine sums for a two-sided comparison, op in OPS; None if it is not one."""
    negate = False
    while isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
        negate, node = not negate, node.operand
    if not isinstance(node, ast.Compare) or len(node.ops) != 1:
        return None
    op = type(node.ops[0])
    op = _FLIP[op] if negate else op
    left, right = _affine(node.left), _affine(node.comparators[0])
    if left is None or right is None:
        return None
    diff = _add(left, _scale(right, -1))           # L op R  <=>  diff op 0,  diff = Q + K
    qpart = {a: c for a, c in diff.items() if "k" not in _atom_sides(a)}
    kpart = {a: c for a, c in diff.items() if "k" in _atom_sides(a)}
    if op in (ast.LtE, ast.Lt):                     # Q + K <= 0  <=>  Q <= -K
        a, b = qpart, _scale(kpart, -1)
    elif op in (ast.GtE, ast.Gt):                   # Q + K >= 0  <=>  -Q <= K
        a, b = _scale(qpart, -1), kpart
    elif all(c < 0 for c in kpart.values()):        # ==, !=: whichever side needs no minus on the keys
        a, b = qpart, _scale(kpart, -1)
    else:
        a, b = _scale(qpart, -1), kpart
    if op in (ast.Lt, ast.Gt):                      # integers: a < b  <=>  a + 1 <= b
        a = _add(a, {"": 1})
    return a, {ast.Eq: "==", ast.NotEq: "!="}.get(op, "<="), b


def _affine(node: ast.AST) -> Optional[Affine]:
    """node as {atom: coefficient}; None when it mixes q and k in a way that does not separate."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return {"": node.value} if node.value else {}
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        left, right = _affine(node.left), _affine(node.right)
        if left is None or right is None:
            return None
        return _add(left, right if isinstance(node.op, ast.Add) else _scale(right, -1))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _affine(node.operand)
        return None if inner is None else _scale(inner, -1)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        left, right = _affine(node.left), _affine(node.right)
        if left is not None and right is not None:
            for factor, other in ((left, right), (right, left)):
                if set(factor) <= {""}:            # a literal factor
                    return _scale(other, factor.get("", 0))
    if _sides(node) == {"q", "k"}:
        return None
    return {ast.unparse(node): 1}


def _atom_sides(atom: str) -> set[str]:
    return _sides(ast.parse(atom, mode="eval").body) if atom else set()


def _add(a: Affine, b: Affine) -> Affine:
    out = dict(a)
    for atom, c in b.items():
        out[atom] = out.get(atom, 0) + c
    return {atom: c for atom, c in out.items() if c}


def _scale(a: Affine, factor: int) -> Affine:
    return {atom: c * factor for atom, c in a.items() if c * factor}


def _implies_causal(a: Affine, op: str, b: Affine) -> bool:
    # -q + c1 <= -k + c2  <=>  k <= q + (c2 - c1): implies k <= q when c2 <= c1
    if op != "<=" or set(a) - {""} != {"q"} or set(b) - {""} != {"k"} or a["q"] != -1 or b["k"] != -1:
        return False
    return b.get("", 0) <= a.get("", 0)


def _format(a: Affine) -> str:
    """An affine sum as a maskfn expression: atoms first, the constant last."""
    text = ""
    for atom, c in sorted(a.items(), key=lambda ac: ac[0] == ""):
        piece = str(abs(c)) if atom == "" else _paren(atom) if abs(c) == 1 else f"{abs(c)} * {_paren(atom)}"
        if not text:
            text = piece if c > 0 else f"-{piece}"
        else:
            text += f" + {piece}" if c > 0 else f" - {piece}"
    return text or "0"


def _paren(atom: str) -> str:
    node = ast.parse(atom, mode="eval").body
    return atom if isinstance(node, (ast.Name, ast.Subscript, ast.Constant, ast.Call)) else f"({atom})"


# ---------------------------------------------------------------- per call: the vectors and their tile bounds


@dataclass(frozen=True)
class TileMask:
    """The terms of one call, ready for the kernels.

    vectors  int64 [n_terms, 2, Bv, L]: [t, 0] term t's query vector A, [t, 1] its key vector B,
             Bv 1 (the mask is the same for the whole batch) or the batch;
    kv_len   keys at and past it are padding (masked_attention's valid_len);
    ops      the op codes (Terms.ops), causal as Terms.causal."""
    vectors: torch.Tensor
    kv_len: int
    ops: int
    causal: bool

    @property
    def n_terms(self) -> int:
        return self.vectors.shape[0]

    @property
    def batch_stride(self) -> int:
        """The vectors' stride over the batch: 0 when one mask serves every batch element."""
        return self.vectors.stride(2) if self.vectors.shape[2] > 1 else 0

    @staticmethod
    def build(terms: Terms, leaves: Sequence[torch.Tensor], seq_len: int, kv_len: int,
              device: torch.device) -> "TileMask":
        cols = []
        for t in terms.terms:
            a = mask_block(t.query, leaves, 0, seq_len, 0, 1, device)     # [B or 1, L, 1]
            b = mask_block(t.key, leaves, 0, 1, 0, seq_len, device)       # [B or 1, 1, L]
            cols += [a.reshape(a.shape[0], seq_len), b.reshape(b.shape[0], seq_len)]
        batch = max(c.shape[0] for c in cols)
        vectors = torch.stack([c.to(torch.int64).expand(batch, seq_len) for c in cols])
        return TileMask(vectors.view(len(terms.terms), 2, batch, seq_len), kv_len, terms.ops, terms.causal)

    def bounds(self, tile_q: int, tile_k: int) -> torch.Tensor:
        """int64 [n_terms, 4, Bv, NT]: rows 0, 1 the min and max of A over each query tile of tile_q
        rows, rows 2, 3 those of B over each key tile of tile_k keys (keys before kv_len only);
        NT covers both tilings, entries past a tiling's end are 0 (never read)."""
        n, _, batch, length = self.vectors.shape
        nq, nk = -(-length // tile_q), -(-length // tile_k)
        width = max(nq, nk)
        out = self.vectors.new_zeros(n, 4, batch, width)
        out[:, 0:2, :, :nq] = _tile_min_max(self.vectors[:, 0], length, tile_q)
        if self.kv_len > 0:
            kk = -(-self.kv_len // tile_k)
            out[:, 2:4, :, :kk] = _tile_min_max(self.vectors[:, 1], self.kv_len, tile_k)
        return out


def _tile_min_max(x: torch.Tensor, n: int, tile: int) -> torch.Tensor:
    """[T, B, L] -> [T, 2, B, cdiv(n, tile)]: min and max of x[..., :n] per tile (the last tile
    padded by repeating its last valid entry)."""
    tiles = -(-n // tile)
    idx = torch.arange(tiles * tile, device=x.device).clamp_(max=n - 1)
    blocks = x[..., idx].view(*x.shape[:-1], tiles, tile)
    return torch.stack([blocks.amin(-1), blocks.amax(-1)], 1)


def leaf_kinds(leaves: Sequence) -> list[str]:
    """"bool" / "int" / "float" of each leaf (a tensor, or anything with a .dtype, or a dtype)."""
    return [_kind_of(x if isinstance(x, torch.dtype) else x.dtype) for x in leaves]

"""Layouts: where the sequence lives in a value, and whether it is split over the `sp` axis.

A layout prints as an einops pattern with the mesh axis written in:
`2 (sp s) 128` is a [2, s, 128] value whose dim 1 is split over `sp`;
`(2 (sp s)) 64` is the merged `(b s)` dim of a flattened batch. The pattern
parser is einops' own (`ParsedExpression`), wrapped so that its errors name the
pattern and the value.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from autosp.errors import AutospError

SEQ = "s"
AXIS = "sp"


@dataclass(frozen=True, slots=True)
class Layout:
    """The sequence sits in dim `dim` as the middle factor of (outer, seq, inner).

    `length` is the global number of valid positions (less than the padded
    `chunk * P` when the length is not a multiple of P, or after `x[:, :-1]`).
    `sharded` False means a replicated value that has a sequence dim.
    """
    dim: int
    length: int
    chunk: int
    outer: int = 1
    inner: int = 1
    sharded: bool = True

    def local_size(self) -> int:
        return self.outer * self.chunk * self.inner

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] = self.local_size()
        return tuple(out)

    def format(self, shape: tuple[int, ...]) -> str:
        seq = f"({AXIS} {SEQ})" if self.sharded else SEQ
        if self.outer != 1 or self.inner != 1:
            parts = ([str(self.outer)] if self.outer != 1 else []) + [seq] + ([str(self.inner)] if self.inner != 1 else [])
            seq = "(" + " ".join(parts) + ")"
        dims = [str(d) for d in shape]
        if 0 <= self.dim < len(dims):
            dims[self.dim] = seq
        return " ".join(dims)


@functools.lru_cache(maxsize=256)
def parse_spec(spec: str) -> tuple[tuple[str, ...], ...]:
    """An einops pattern -> its composition, one tuple of axis names per dim."""
    from einops import EinopsError
    from einops.parsing import ParsedExpression
    try:
        parsed = ParsedExpression(spec)
    except EinopsError as exc:
        raise AutospError(f"layout spec {spec!r}: {exc}. Fix: write an einops pattern such as 'b s' or "
                          "'b (sp s) d', one name per dim, the sequence named 's'.") from None
    if parsed.has_ellipsis:
        raise AutospError(f"layout spec {spec!r}: '...' is not supported. Fix: name every dim, e.g. 'b s d'.")
    return tuple(tuple(str(a) for a in group) if isinstance(group, list) else (str(group),)
                 for group in parsed.composition)


def seq_dim_of_spec(spec: str, shape: tuple[int, ...], what: str) -> int | None:
    """The dim a spec names as the sequence ('s' alone or inside a group), or None."""
    comp = parse_spec(spec)
    if len(comp) != len(shape):
        raise AutospError(f"{what}: spec {spec!r} names {len(comp)} dims but the value has shape {list(shape)}. "
                          f"Fix: one name per dim, e.g. {' '.join('s' if i == 1 else f'd{i}' for i in range(len(shape)))!r}.")
    dims = [i for i, group in enumerate(comp) if SEQ in group]
    if len(dims) > 1:
        raise AutospError(f"{what}: spec {spec!r} names the sequence {SEQ!r} more than once.")
    for i, group in enumerate(comp):
        if SEQ in group and any(a not in (SEQ, AXIS) for a in group):
            raise AutospError(f"{what}: spec {spec!r} merges the sequence with other axes in dim {i}; "
                              "Fix: give the sequence its own dim in the spec.")
    return dims[0] if dims else None

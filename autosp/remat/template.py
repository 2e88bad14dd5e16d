"""Templates: repeated layers are planned once. Equations with the same neighbourhood share a class.

A class is found by colour refinement (Weisfeiler-Lehman) over the forward equations: an
equation's first colour is its op, its static arguments and its input and output types;
each round adds the colours of its inputs' producers and of its outputs' readers. After a
few rounds the equations of identical layers share colours, except within the radius of a
boundary (the first layer's embedding input, the last layer's head): "the last layer may
get its own". Colours are numbered in order of first appearance, so every rank that traces
the same graph gets the same classes.

`tie` maps an IlpProblem onto one variable per class: a tied assignment is a plan in which
every layer of a template makes the same choices; its memory and cost are those of all the
members (intervals and costs add up), so the tied problem is exact for such plans.
"""
from __future__ import annotations

import numpy as np

from autosp.ir.core import In, Var
from autosp.remat.problem import IlpProblem


def _static(e) -> str:
    def fmt(a):
        if isinstance(a, In):
            return "#"
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(fmt(x) for x in a) + "]"
        return repr(a)
    return fmt(e.args) + fmt(tuple(e.kwargs))


def eqn_classes(eqns, radius: int = 3) -> list[int]:
    """A class id per equation; equal ids: equal neighbourhoods up to `radius` hops."""
    ids: dict = {}

    def number(key) -> int:
        return ids.setdefault(key, len(ids))

    def vtype(v: Var):
        return (str(v.dtype), v.shape)

    color = [number(("e", e.op.name, _static(e), tuple(vtype(x) for x in e.inputs),
                     tuple(vtype(o) for o in e.outputs))) for e in eqns]
    # the outputs of a split into pieces of one type, and the inputs of a cat of pieces of one type,
    # are interchangeable here (a tiled chain's tiles, passes/tile.py): their position is not part of
    # the colour, so the tiles of a chain share classes and are planned alike
    def alike(vs) -> bool:
        return len(vs) > 1 and len({vtype(v) for v in vs}) == 1

    producer = {o.name: (k, 0 if e.multi and alike(e.outputs) else i)
                for k, e in enumerate(eqns) for i, o in enumerate(e.outputs)}
    readers: dict[str, list[tuple[int, int]]] = {}
    for k, e in enumerate(eqns):
        same = e.op.name == "cat" and alike(e.inputs)
        for pos, x in enumerate(e.inputs):
            readers.setdefault(x.name, []).append((k, 0 if same else pos))
    for _ in range(radius):
        def vcolor(x: Var):
            if x.name in producer:
                k, i = producer[x.name]
                return (color[k], i)
            return ("in", str(x.role), vtype(x))
        color = [number(("r", color[k], tuple(vcolor(x) for x in e.inputs),
                         tuple(tuple(sorted((color[c], p) for c, p in readers.get(o.name, ()))) for o in e.outputs)))
                 for k, e in enumerate(eqns)]
    # renumber densely in order of first appearance
    dense: dict[int, int] = {}
    return [dense.setdefault(c, len(dense)) for c in color]


def layer_groups(classes: list[int], halves: int = 2) -> list[int]:
    """Split each class by position: its last member (the last layer, first in the backward, whose
    memory is freed first) alone, the others in `halves` runs of consecutive members, so plans
    may differ between the start, the middle and the end of the stack."""
    members: dict[int, list[int]] = {}
    for k, c in enumerate(classes):
        members.setdefault(c, []).append(k)
    group = [0] * len(classes)
    for ks in members.values():
        m = len(ks)
        for j, k in enumerate(ks):
            group[k] = halves if (j == m - 1 and m >= 3) else min(halves - 1, j * halves // max(1, m - 1))
    return group


def variable_classes(p: IlpProblem, forward_eqns, radius: int = 3, halves: int = 2) -> list[int]:
    """A class per binary variable of p: r by its equation's (class, group), s and o by their producer's."""
    ec = eqn_classes(forward_eqns, radius)
    grp = layer_groups(ec, halves)
    nK = len(p.eqns)
    out_index = {}
    for k in p.eqns:
        for i, o in enumerate(forward_eqns[k].outputs):
            out_index[o.name] = i
    keys = [("r", ec[k], grp[k]) for k in p.eqns]
    for kind in ("s", "o"):
        keys += [(kind, ec[p.eqns[p.value_eqn[i]]], grp[p.eqns[p.value_eqn[i]]], out_index[n])
                 for i, n in enumerate(p.values)]
    dense: dict = {}
    assert len(keys) == nK + 2 * len(p.values)
    return [dense.setdefault(k, len(dense)) for k in keys]


def tie(p: IlpProblem, classes: list[int]) -> tuple[IlpProblem, np.ndarray]:
    """(the problem over one variable per class, the class of each original binary)."""
    cls = np.asarray(classes)
    n = int(cls.max()) + 1 if len(cls) else 0
    cost = np.zeros(n)
    flops = np.zeros(n)
    for j, c in enumerate(cls):
        cost[c] = np.inf if np.isinf(p.cost[j]) or np.isinf(cost[c]) else cost[c] + p.cost[j]
        flops[c] += p.flops[j]
    rows, seen = [], set()
    for terms, lo, hi in p.rows:
        acc: dict[int, float] = {}
        for j, v in terms:
            acc[int(cls[j])] = acc.get(int(cls[j]), 0.0) + v
        t = tuple(sorted((j, v) for j, v in acc.items() if v != 0))
        if not t:
            continue
        key = (t, lo, hi)
        if key not in seen:
            seen.add(key)
            rows.append((list(t), lo, hi))
    intervals: list[list] = [[] for _ in range(n)]
    for j, ivs in enumerate(p.intervals[:p.n_bin]):
        intervals[cls[j]].extend(ivs)
    aux_of: dict = {}
    aux, aux_iv = [], []
    for a, groups in enumerate(p.aux):
        g = tuple(sorted({tuple(sorted((int(cls[x]), int(cls[y])))) for x, y in groups}))
        if g not in aux_of:
            aux_of[g] = len(aux)
            aux.append(list(g))
            aux_iv.append([])
        aux_iv[aux_of[g]].extend(p.intervals[p.n_bin + a])
    q = IlpProblem(p.eqns, p.eqn_names, p.values, p.value_bytes, p.value_eqn, cost, flops, rows, p.base,
                   p.n_forward, intervals + aux_iv, aux)
    return q, cls


def untie(xt: np.ndarray, cls: np.ndarray) -> np.ndarray:
    return np.asarray(xt)[cls]


def repeats(eqns, least: int = 4) -> list[tuple[int, int, int, int]]:
    """The runs of repeated layers in a program, as (start, period, count, rest): equations [start + j period,
    start + (j + 1) period) for j < count are alike equation by equation (op, static arguments, input types), with
    count >= 2 and period >= `least`, and the `rest` (< period) after them are alike the first `rest` of each (a
    last layer that ends otherwise, where the next layer's would begin). The run covering the most equations first,
    then the same search before and after it. A lowering that places its cuts alike in each repetition gets the same
    code for each (runtime.memory_cuts, for inductor's cache)."""
    keys: dict = {}
    sig = [keys.setdefault((e.op.name, _static(e), tuple((str(x.dtype), x.shape) for x in e.inputs)), len(keys))
           for e in eqns]
    out: list[tuple[int, int, int, int]] = []

    def search(lo: int, hi: int) -> None:
        last: dict[int, int] = {}
        gaps: dict[int, int] = {}
        for k in range(lo, hi):
            if sig[k] in last and k - last[sig[k]] >= least:
                g = k - last[sig[k]]
                gaps[g] = gaps.get(g, 0) + 1
            last[sig[k]] = k
        best = None                                 # (covered, -period, start, period, count)
        for p in sorted(gaps, key=gaps.get, reverse=True)[:16]:
            k = lo
            while k + p < hi:                       # each maximal run [a, k) of sig[i] == sig[i + p]
                a = k
                while k + p < hi and sig[k] == sig[k + p]:
                    k += 1
                count, rest = divmod(k - a + p, p)  # [a, k + p) holds this many whole periods, and the rest
                if count >= 2 and (best is None or (k - a + p, -p) > best[:2]):
                    best = (k - a + p, -p, a, p, count, rest)
                k += 1
        if best is None:
            return
        _, _, start, p, count, rest = best
        out.append((start, p, count, rest))
        search(lo, start)
        search(start + count * p + rest, hi)

    search(0, len(eqns))
    return sorted(out)

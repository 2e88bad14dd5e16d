"""Solve an IlpProblem with HiGHS (scipy.optimize.milp); brute force for tests.

Memory rows are generated lazily: the solve starts from the rows at the baseline's peaks,
the forward/backward seam and the times where the most could be live, then adds the rows
the answer violates until none is, so a program with thousands of time points solves with
a few dozen rows. The answer is exact for the problem's model; how the rewritten program
really uses memory is simulated afterwards (plan.py).
"""
from __future__ import annotations

import contextlib
import os
import sys

import numpy as np

from autosp.remat.problem import IlpProblem


@contextlib.contextmanager
def _quiet():
    """Some HiGHS builds print debugging lines to the C stdout even with disp off: silence fd 1."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


class Infeasible(Exception):
    """No assignment fits the budget."""


def _row(p: IlpProblem, t: int) -> tuple[list[int], list[float]]:
    """The memory row at time t: each variable's bytes live at t (from its intervals)."""
    j, a, z, w = _interval_arrays(p)
    hit = (a <= t) & (t <= z)
    weights = np.bincount(j[hit], weights=w[hit], minlength=p.n_vars)
    cols = np.flatnonzero(weights)
    return cols.tolist(), weights[cols].tolist()


def _interval_arrays(p: IlpProblem):
    """p.intervals flattened to arrays (variable, first t, last t, bytes), cached per placement."""
    hit = getattr(p, "_flat", None)
    if hit is None or hit[0] is not p.intervals:
        flat = [(j, a, z, b) for j, ivs in enumerate(p.intervals) for a, z, b in ivs]
        arr = np.array(flat, dtype=np.float64).reshape(-1, 4)
        hit = (p.intervals, arr[:, 0].astype(np.int64), arr[:, 1], arr[:, 2], arr[:, 3])
        p._flat = hit
    return hit[1:]


def _seed_rows(p: IlpProblem, k: int = 4) -> set[int]:
    T = p.n_times
    if T == 0:
        return set()
    rows = {min(p.n_forward, T - 1), max(0, p.n_forward - 1), int(np.argmax(p.base))}
    if p.n_forward < T:
        rows.add(p.n_forward + int(np.argmax(p.base[p.n_forward:])))
    full = p.memory(np.ones(p.n_vars))          # the upper envelope: everything that could be live
    for t in np.argsort(-full)[:k]:
        rows.add(int(t))
    return rows


GAP = 1e-4          # relative MIP gap: a ten-thousandth of the recompute time is not worth searching for
TIME_LIMIT = 20.0   # seconds per MIP; past it HiGHS's best answer so far is taken (plans are broadcast)
_LIMITED = [0]      # MIPs of this process ended by their time limit: a plan made with one is not kept (store.py)


def milp(c, **kwargs):
    """scipy.optimize.milp, imported at the first MIP: scipy's import is a second of every process that imports
    autosp.remat, and a rank that receives its plan never solves one."""
    from scipy.optimize import milp as scipy_milp
    return scipy_milp(c, **kwargs)


def time_limits() -> int:
    """How many MIPs of this process have ended by their time limit so far."""
    return _LIMITED[0]


def _solve_rows(p: IlpProblem, rows: set[int], budget: float | None, minimize_peak: bool, gap: float = GAP,
                feasibility: bool = False, time_limit: float | None = None, node_limit: int | None = None):
    from scipy.optimize import Bounds, LinearConstraint
    from scipy.sparse import coo_matrix
    nb, n = p.n_bin, p.n_vars
    cost = np.nan_to_num(p.cost, posinf=0.0)
    ub = np.concatenate([np.where(np.isinf(p.cost), 0.0, 1.0), np.ones(n - nb)])
    scale = max(1.0, float(np.max(p.value_bytes))) if len(p.value_bytes) else 1.0
    # HiGHS stops within an absolute gap of 1e-6: seconds of recomputation are scaled so that the
    # cheapest recomputation costs 1
    unit = float(np.min(cost[cost > 0])) if np.any(cost > 0) else 1.0
    c = np.concatenate([cost / unit, np.zeros(n - nb)])
    if feasibility:
        c = np.zeros_like(c)
    if minimize_peak:
        # the peak alone (a budget solve at that peak then finds the cheapest plan)
        c = np.append(np.zeros_like(c), 1.0)
        ub = np.append(ub, np.inf)
    r_i, r_j, r_v, lo, hi = [], [], [], [], []

    def add(terms, rlo, rhi):
        i = len(lo)
        for j, v in terms:
            r_i.append(i)
            r_j.append(j)
            r_v.append(v)
        lo.append(rlo)
        hi.append(rhi)

    for terms, rlo, rhi in p.rows:
        add(terms, rlo, rhi)
    for a, groups in enumerate(p.aux):
        for x, y in groups:                      # z >= x + y - 1
            add([(nb + a, 1.0), (x, -1.0), (y, -1.0)], -1.0, np.inf)
    for t in sorted(rows):
        cols, vals = _row(p, t)
        terms = list(zip(cols, vals))
        if minimize_peak:               # in units of the widest value: bytes alone span too many decades
            add([(j, v / scale) for j, v in terms] + [(n, -1.0)], -np.inf, -p.base[t] / scale)
        else:
            add(terms, -np.inf, budget - p.base[t])
    width = n + (1 if minimize_peak else 0)
    A = coo_matrix((r_v, (r_i, r_j)), shape=(len(lo), width)).tocsr()
    integrality = np.concatenate([np.ones(nb), np.zeros(width - nb)])
    options = {"disp": False, "mip_rel_gap": gap, "time_limit": TIME_LIMIT if time_limit is None else time_limit,
               **({"node_limit": node_limit} if node_limit else {})}
    problem = dict(constraints=LinearConstraint(A, lo, hi), integrality=integrality, bounds=Bounds(np.zeros(width), ub))
    with _quiet():
        try:
            res = milp(c, **problem, options=dict(options))
        except ValueError:
            # HiGHS's presolve can fail inside (seen: "vector::reserve" on a least-peak MIP of Llama 3.2 1B, whose
            # coefficients span 9 decades); the same MIP without it solved in 0.9 s
            res = milp(c, **problem, options=dict(options, presolve=False))
    if res.status == 1 and "time limit" in str(res.message).lower():
        _LIMITED[0] += 1
    if res.x is None:
        return None
    return np.round(res.x[:nb])


def solve(p: IlpProblem, budget: float | None = None, *, minimize_peak: bool = False,
          max_rounds: int = 60, gap: float | None = None, feasibility: bool = False,
          time_limit: float | None = None, known: set[int] | None = None, node_limit: int | None = None) -> np.ndarray:
    """The cheapest binary assignment whose modelled memory stays within `budget` at every time
    point (or, with minimize_peak, one with the smallest peak). Raises Infeasible. `known`: time
    points whose rows earlier solves of the same problem needed; they start this solve, and the
    rows this one adds are added to it (a row holds at every budget, so sharing them is exact).
    `node_limit`: branch-and-bound nodes per MIP, past which a MIP without an answer is Infeasible
    (a deterministic limit, unlike time: the least-peak search's feasibility solves)."""
    rows = _seed_rows(p) | (known or set())
    x = None
    for _ in range(max_rounds):
        x = _solve_rows(p, rows, budget, minimize_peak, GAP if gap is None else gap, feasibility, time_limit,
                        node_limit)
        if x is None:
            raise Infeasible()
        mem = p.memory(x)
        if minimize_peak:                                     # the peak the MIP saw, over its rows
            limit = max(float(mem[t]) for t in rows) if rows else -np.inf
        else:
            limit = budget
        over = np.flatnonzero(mem > limit * (1 + 1e-9))
        new = [int(t) for t in over[np.argsort(-mem[over])] if int(t) not in rows][:16]
        if not new:
            return x
        rows.update(new)
        if known is not None:
            known.update(new)
    return x


def brute_force(p: IlpProblem, budget: float) -> tuple[float, np.ndarray] | None:
    """(objective, x) of the best assignment by enumeration; for tests on small problems.

    Enumerates the recomputation choices r (offload must be off); for each, the least memory
    that satisfies the rows saves exactly the needed values whose equation is not recomputed
    (saving more costs memory and gains nothing). Rows and memory are evaluated in batches.
    """
    nK, nV = len(p.eqns), len(p.values)
    if not np.all(np.isinf(p.cost[nK + nV:])):
        raise ValueError("brute_force enumerates recomputations only: plan without offload")
    free = [j for j in range(nK) if not np.isinf(p.cost[j])]
    n = p.n_vars
    # dense forms of the rows, the auxiliaries and the memory intervals
    A = np.zeros((len(p.rows), p.n_bin))
    lo = np.array([r[1] for r in p.rows])
    hi = np.array([r[2] for r in p.rows])
    for i, (terms, _, _) in enumerate(p.rows):
        for j, c in terms:
            A[i, j] += c
    M = np.zeros((n, p.n_times))
    for j, ivs in enumerate(p.intervals):
        for a, b, w in ivs:
            M[j, a:b + 1] += w
    cost = np.nan_to_num(p.cost, posinf=0.0)
    best = None
    for start in range(0, 1 << len(free), 1 << 14):
        idx = np.arange(start, min(start + (1 << 14), 1 << len(free)))
        X = np.zeros((len(idx), p.n_bin))
        X[:, free] = (idx[:, None] >> np.arange(len(free))) & 1
        # saves follow: a value is saved iff the rows demand it (a direct read, or a recomputed reader)
        need = np.zeros((len(idx), nV), dtype=bool)
        for i, (terms, rlo, _) in enumerate(p.rows):
            svars = [j - nK for j, c in terms if nK <= j < nK + nV and c > 0]
            if len(svars) != 1 or rlo < 0:
                continue
            rest = sum(X[:, j] * c for j, c in terms if j < nK)
            need[:, svars[0]] |= rest < rlo - 1e-9
        X[:, nK:nK + nV] = need
        ok = np.all((X @ A.T >= lo - 1e-9) & (X @ A.T <= hi + 1e-9), axis=1)
        Z = np.stack([np.max(np.stack([np.minimum(X[:, a], X[:, b]) for a, b in groups]), axis=0)
                      for groups in p.aux], axis=1) if p.aux else np.zeros((len(idx), 0))
        mem = p.base + np.concatenate([X, Z], axis=1) @ M
        ok &= np.max(mem, axis=1) <= budget * (1 + 1e-9)
        if not ok.any():
            continue
        obj = X @ cost
        obj[~ok] = np.inf
        k = int(np.argmin(obj))
        if best is None or obj[k] < best[0] - 1e-15:
            best = (float(obj[k]), X[k].copy())
    return best

"""Checkpoints at cuts: per-layer checkpointing, found in the program's dataflow.

A cut is a point of the forward order where the values crossing it (made before it, read after it by
equations the backward may recompute) are few: in a transformer, the residual stream alone (and small
values every layer reads, such as rotary tables) crosses between two layers and between the attention
and MLP halves of one. Keeping the values crossing a set of cuts (saved, or offloaded to the host) and
recomputing everything else the backward reads is the plan a user writes by hand with per-layer
checkpointing, and ALST's (its checkpoints offloaded). The ILP places a recomputation by its first
reader seen one level deep (problem.py), so long chains of recomputation, which these plans are made
of, are where its model errs most: the least-peak search (plan.py) simulates these plans beside the
ILP's answers, and the simulation judges all of them alike.

    for how, x in checkpoint_plans(problem, needs, activations(joint), host=64 * 2**30):
        program = apply_plan(...)        # plan.py's _program(joint, problem, x)
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from autosp.ir.core import Role
from autosp.remat.problem import IlpProblem, Needs


def activations(joint) -> set[str]:
    """The forward values that depend on the batch (a Role.INPUT of the graph): not the parameters'
    gathers, casts and the tables made from them, which any plan recomputes from the parameters."""
    dep = {v.name for v in joint.graph.inputs if v.role is Role.INPUT}
    for e in joint.forward_eqns:
        if any(x.name in dep for x in e.inputs):
            dep.update(o.name for o in e.outputs)
    return dep


def _last_reads(needs: Needs, among=None) -> np.ndarray:
    """Per value: the position of the last needed equation that reads it (-1: none, or not `among`)."""
    return np.array([max(needs.consumers.get(v, ()), default=-1) if among is None or i in among else -1
                     for i, v in enumerate(needs.values)], dtype=np.int64)


def crossing(problem: IlpProblem, needs: Needs, among=None) -> np.ndarray:
    """Bytes of the values (`among` them: positions in problem.values; None: all) crossing the point
    after each equation position: made at or before it, read by a needed equation after it."""
    nK = len(problem.eqns)
    diff = np.zeros(nK + 1)
    for i, z in enumerate(_last_reads(needs, among)):
        a = int(problem.value_eqn[i])
        if z > a:
            diff[a] += problem.value_bytes[i]
            diff[z] -= problem.value_bytes[i]
    return np.cumsum(diff)[:-1]


def units(problem: IlpProblem, needs: Needs, acts: set[str], n: int = 2) -> list[float]:
    """The `n` value sizes that hold the most bytes among the activations, the most first: a transformer's residual
    stream, or where more values share the MLP's width (LoRA's adapters add B A x and its scaled copy beside every
    projection) that width first and the residual's second."""
    weight = Counter()
    for i, v in enumerate(needs.values):
        if v in acts:
            weight[float(problem.value_bytes[i])] += float(problem.value_bytes[i])
    return [size for size, _ in weight.most_common(n)]


def cuts(problem: IlpProblem, needs: Needs, acts: set[str], slack: float = 0.5,
         unit: float | None = None) -> list[list[int]]:
    """The cuts of the forward, in order, each as the activations (`acts`: names; positions in
    problem.values returned) crossing it. The unit is the size that holds the most bytes among the
    activations (a transformer's residual stream); a cut is a point where between a half and
    1 + `slack` units of activations cross, and of the points one value dominates (the same residual,
    a norm's first steps later) the one where the fewest bytes cross."""
    among = {i for i, v in enumerate(needs.values) if v in acts}
    if not among:
        return []
    if unit is None:
        unit = units(problem, needs, acts, 1)[0]
    B = crossing(problem, needs, among)
    made = problem.value_eqn
    last = _last_reads(needs, among)
    out: list[tuple[int, float, list[int]]] = []            # (dominant value, bytes, crossing values)
    for p in np.flatnonzero((B >= 0.5 * unit) & (B <= (1 + slack) * unit)):
        across = [int(i) for i in np.flatnonzero((made <= p) & (last > p))]
        top = max(across, key=lambda i: problem.value_bytes[i])
        if out and out[-1][0] == top:
            if B[p] < out[-1][1]:
                out[-1] = (top, float(B[p]), across)
            continue
        out.append((top, float(B[p]), across))
    return [c for _, _, c in out]


def checkpoint_plan(problem: IlpProblem, needs: Needs, keep: set[int], host: float | None = None) -> np.ndarray:
    """The assignment that keeps the values `keep` (positions in problem.values) where the backward
    or a recomputation reads them, and recomputes everything else it reads, back to them (a value
    whose equation cannot be recomputed is kept too). Kept values are offloaded where offloading is
    allowed, the earliest first, while they fit in `host` bytes (None: no limit); the rest are saved."""
    nK, nV = len(problem.eqns), len(problem.values)
    vpos = {v: i for i, v in enumerate(needs.values)}
    reads: list[list[int]] = [[] for _ in range(nK)]          # eqn position -> the storages it reads
    for v, cs in needs.consumers.items():
        for c in cs:
            reads[c].append(vpos[v])
    x = np.zeros(problem.n_bin)
    kept: set[int] = set()
    todo = [vpos[v] for v in needs.first_direct if v in vpos]
    seen: set[int] = set()
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        p = int(problem.value_eqn[i])
        if i in keep or np.isinf(problem.cost[p]):
            kept.add(i)
            continue
        if not x[p]:
            x[p] = 1.0
            todo.extend(reads[p])
    room = np.inf if host is None else float(host)
    for i in sorted(kept, key=lambda i: (problem.value_eqn[i], i)):
        o = nK + nV + i
        if not np.isinf(problem.cost[o]) and problem.value_bytes[i] <= room:
            x[o] = 1.0
            room -= problem.value_bytes[i]
        else:
            x[nK + i] = 1.0
    return x


def checkpoint_plans(problem: IlpProblem, needs: Needs, acts: set[str],
                     host: float | None = None) -> list[tuple[str, np.ndarray]]:
    """Per-layer checkpointing at every cut, every other cut (both phases) and every fourth: (how,
    assignment) of each that keeps the activations crossing them (checkpoint_plan), the feasible ones,
    without repeats; the cuts of each of the two sizes that hold the most activation bytes (units), since which of
    them is the residual stream's depends on the model. `acts`: activations(joint)."""
    out, seen = [], set()
    for unit in units(problem, needs, acts):
        found = cuts(problem, needs, acts, unit=unit)
        for (step, phase), which in _SPACINGS.items():
            chosen = found[phase::step]
            if not chosen or (step > 1 and len(found) < 2 * step):
                continue
            x = checkpoint_plan(problem, needs, {i for c in chosen for i in c}, host)
            key = x.tobytes()
            if key not in seen and problem.feasible(x):
                seen.add(key)
                out.append((f"per-layer checkpointing: what crosses {which} of {len(found)} kept", x))
    return out


def with_narrow(problem: IlpProblem, needs: Needs, acts: set[str], joins: set[str], x: np.ndarray,
                host: float | None = None) -> np.ndarray | None:
    """Per-layer checkpointing `x` (checkpoint_plan's) that also keeps the narrow joins the backward reads: values
    `joins` names (a cat of a tiled chain's pieces) of at most a quarter of the larger unit (LoRA's A h beside a
    tiled MLP's down projection). None where there are none to keep. Recomputing such a join recomputes every
    tile's hidden at once, held to each tile's own backward: LoRA's least peak at tiny, 4,096 tokens, sp 2, was
    24.4 MiB against full fine-tuning's 18.7."""
    nK, nV = len(problem.eqns), len(problem.values)
    unit = units(problem, needs, acts)
    if not unit or not joins:
        return None
    kept = {i for i in range(nV) if x[nK + i] > 0.5 or x[nK + nV + i] > 0.5}
    narrow = {i for i, v in enumerate(needs.values) if v in joins and v in acts and v in needs.first_direct
              and problem.value_bytes[i] <= max(unit) / 4} - kept
    if not narrow:
        return None
    y = checkpoint_plan(problem, needs, kept | narrow, host)
    return y if problem.feasible(y) and not np.array_equal(y, x) else None


# (every n-th cut, from the k-th) -> how it reads: in a transformer, every cut is every half-layer, every other
# cut from the first is every layer's input (ALST's checkpoints)
_SPACINGS = {(1, 0): "every cut", (2, 0): "every other cut from the first", (2, 1): "every other cut from the second",
             (4, 0): "every fourth cut"}

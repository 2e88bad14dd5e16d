"""The remat problem as data: which forward values the backward reads, what each choice costs,
and the memory of the schedule as intervals.

Variables (binary): r[k] for each forward equation k that the backward may need (recompute
it in the backward); s[v] and o[v] for each forward storage v (save it, offload it). Views
own no storage: recomputing one is free and makes its base needed instead. A var x is
available to the backward if its equation is recomputed, or (for a storage) it is saved or
offloaded. Constraints: every var the backward reads directly is available; a recomputed
equation's forward inputs are available; nothing is kept that nobody reads; random
equations are never recomputed. With a host memory capacity (`host_limit`), one more row: the
offloaded bytes, sum of bytes[v] o[v], stay within it.

Memory, in bytes per rank, is modelled on the executed order (liveness.py): time points are
the forward's equations then the backward's. `base[t]` is the bytes live at t when the
forward saves nothing and the backward's forward inputs are free; each variable adds bytes
over intervals of time when set: a saved storage from its last forward use to its last
backward need; a recomputed equation's outputs from their first backward need to their last;
an offloaded storage from its prefetch to its last need.

When a value is first needed depends on the plan: apply.py recomputes an equation right
before its first reader, which may itself be a recomputation. `Needs.intervals(R)` places
the intervals for a given set R of recomputed equations (a consumer outside R that would
need the value is looked at as if it joined R); plan.py iterates plan -> R -> intervals
until they agree, and the simulation of the rewritten program has the last word.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from autosp.ir.aliases import aliases, roots
from autosp.ir.ops import Tag
from autosp.passes.autodiff import Joint
from autosp.remat import liveness as L
from autosp.remat.apply import apply_plan
from autosp.remat.cost import Device, eqn_cost

INF = 1 << 62


@dataclass
class IlpProblem:
    """x = [r (one per eqn), s (one per value), o (one per value)] binary, then the auxiliaries.

    An auxiliary z is continuous in [0, 1] and stands for an OR of ANDs of two binaries,
    z >= x_a + x_b - 1 for each (a, b) in its groups: the memory of a recomputation pulled
    early by a recomputed reader, or of a saved value kept late for one (Needs.place).
    """
    eqns: list[int]                   # forward equation indices (joint numbering)
    eqn_names: list[str]              # first output name of each, for printing
    values: list[str]                 # forward storages (root var names)
    value_bytes: np.ndarray
    value_eqn: np.ndarray             # position in `eqns` of the equation producing each value
    cost: np.ndarray                  # seconds per binary variable if set (inf: not allowed)
    flops: np.ndarray                 # FLOPs per binary variable if set (recomputations only)
    rows: list[tuple[list[tuple[int, float]], float, float]]   # (terms, lo, hi): lo <= sum c x <= hi
    base: np.ndarray                  # (T,) bytes live at each time point with nothing set
    n_forward: int                    # time points [0, n_forward) are the forward's
    intervals: list = None            # per variable (binaries, then auxiliaries): [(first t, last t, bytes)]
    aux: list = None                  # per auxiliary: [(a, b), ...] binaries whose AND makes it 1

    @property
    def n_bin(self) -> int:
        return len(self.cost)

    @property
    def n_vars(self) -> int:
        return self.n_bin + len(self.aux or ())

    @property
    def n_times(self) -> int:
        return len(self.base)

    def complete(self, xb: np.ndarray) -> np.ndarray:
        """A binary assignment with its auxiliaries filled in (their smallest feasible values)."""
        xb = np.asarray(xb, dtype=np.float64)[:self.n_bin]
        z = [max((min(xb[a], xb[b]) for a, b in groups), default=0.0) for groups in self.aux]
        return np.concatenate([xb, np.array(z, dtype=np.float64)])

    def memory(self, x: np.ndarray) -> np.ndarray:
        """Bytes at every time point for an assignment (binaries, or binaries and auxiliaries)."""
        x = self.complete(x) if len(x) == self.n_bin else np.asarray(x)
        diff = np.zeros(self.n_times + 1)
        for j in np.flatnonzero(x > 1e-9):
            for a, b, w in self.intervals[j]:
                diff[a] += w * x[j]
                diff[b + 1] -= w * x[j]
        return self.base + np.cumsum(diff)[:-1]

    def feasible(self, x: np.ndarray) -> bool:
        x = np.asarray(x)[:self.n_bin]
        if np.any(np.isinf(self.cost[x > 0.5])):
            return False
        for terms, lo, hi in self.rows:
            v = sum(c * x[j] for j, c in terms)
            if v < lo - 1e-9 or v > hi + 1e-9:
                return False
        return True

    def objective(self, x: np.ndarray) -> float:
        x = np.asarray(x)[:self.n_bin]
        return float(np.sum(np.where(x > 0.5, np.nan_to_num(self.cost, posinf=0.0), 0.0)))

    def recomputed(self, x: np.ndarray) -> frozenset[int]:
        return frozenset(p for p in range(len(self.eqns)) if x[p] > 0.5)


@dataclass
class Needs:
    """When the backward reads each forward var, and which recomputations could read it."""
    n_forward: int
    lead: int
    eqns: list[int]
    outputs: list[list[str]]                 # per eqn position: its output var names
    out_bytes: list[list[float]]             # their storage bytes (0 for views)
    consumers: dict[str, list[int]]          # var -> eqn positions that read it
    first_direct: dict[str, int]
    last_direct: dict[str, int]
    values: list[str]
    value_views: list[list[str]]             # per storage: the vars living in it (itself and its views)
    value_bytes: np.ndarray
    save_start: list[int]                    # per storage: first time a save extends its life

    def placement(self, recomputed: frozenset[int]) -> list[int]:
        """Eqn position -> the backward time it is recomputed at, were it recomputed, given that the
        equations in `recomputed` are (apply.py's rule: right before its first reader)."""
        pi = [INF] * len(self.eqns)
        for p in reversed(range(len(self.eqns))):
            t = INF
            for o in self.outputs[p]:
                t = min(t, self.first_direct.get(o, INF))
                for c in self.consumers.get(o, ()):
                    if c in recomputed:
                        t = min(t, pi[c])
            if t >= INF:          # read only by recomputations outside the plan: as if the first joined it
                t = min((pi[c] for o in self.outputs[p] for c in self.consumers.get(o, ())), default=INF)
            pi[p] = t
        return pi

    def _last(self, name: str, pi, recomputed) -> int:
        t = self.last_direct.get(name, -1)
        for c in self.consumers.get(name, ()):
            if c in recomputed and pi[c] < INF:
                t = max(t, pi[c])
        return t

    def place(self, p: IlpProblem, recomputed: frozenset[int]) -> None:
        """Set p.intervals and p.aux for the plan whose recomputed equations are `recomputed`."""
        cache = self.__dict__.setdefault("_placed", {})
        if recomputed not in cache:
            if len(cache) > 32:
                cache.clear()
            cache[recomputed] = self._place(recomputed)
        p.intervals, p.aux = cache[recomputed]

    def _place(self, recomputed: frozenset[int]):
        nF, nK, nV = self.n_forward, len(self.eqns), len(self.values)
        pi = self.placement(recomputed)
        ivs: list[list[tuple[int, int, float]]] = [[] for _ in range(nK + 2 * nV)]
        aux: list[list[tuple[int, int]]] = []

        def add_aux(groups, intervals):
            intervals = [(a, b, w) for a, b, w in intervals if w > 0 and a <= b]
            if groups and intervals:
                aux.append(groups)
                ivs.append(intervals)

        for q in range(nK):
            own = min((self.first_direct.get(o, INF) for o in self.outputs[q]), default=INF)
            readers = sorted({(pi[c], c) for o in self.outputs[q] for c in self.consumers.get(o, ())
                              if pi[c] < own and pi[c] < INF})
            if own >= INF and not readers:
                continue
            lasts = [max(self._last(o, pi, recomputed), own if own < INF else -1) for o in self.outputs[q]]
            times = sorted({t for t, _ in readers})
            for o, b, last in zip(self.outputs[q], self.out_bytes[q], lasts):
                if b and own < INF:
                    ivs[q].append((nF + own, nF + max(own, last), b))
            # pulled early: from the earliest recomputed reader's time, up to its own first read
            for j, t in enumerate(times):
                stop = times[j + 1] - 1 if j + 1 < len(times) else (own - 1 if own < INF else None)
                groups = [(q, c) for tc, c in readers if tc <= t]
                pieces = [(nF + t, nF + (stop if stop is not None else max(t, last)), b)
                          for b, last in zip(self.out_bytes[q], lasts)]
                add_aux(groups, pieces)
        for i, views in enumerate(self.value_views):
            b = float(self.value_bytes[i])
            direct_last = max((self.last_direct.get(v, -1) for v in views), default=-1)
            readers = sorted({(pi[c], c) for v in views for c in self.consumers.get(v, ()) if pi[c] < INF})
            s_var, o_var = nK + i, nK + nV + i
            ivs[s_var].append((self.save_start[i], nF + direct_last, b))
            # kept late for recomputed readers: until the latest one that is recomputed
            late = sorted({t for t, _ in readers if t > direct_last})
            prev = direct_last
            for t in late:
                groups = [(s_var, c) for tc, c in readers if tc >= t]
                add_aux(groups, [(nF + prev + 1, nF + t, b)])
                prev = t
            first = min([self.first_direct.get(v, INF) for v in views] + [t for t, c in readers if c in recomputed])
            last = max([direct_last] + [t for t, c in readers if c in recomputed])
            if first < INF and last >= 0:
                ivs[o_var].append((nF + max(0, first - self.lead), nF + last, b))
        return ivs, aux


def build(joint: Joint, device: Device, offload: bool = False, lead: int = 8) -> tuple[IlpProblem, Needs]:
    g = joint.graph
    fwd = joint.forward_eqns
    bwd = joint.backward_eqns
    producer = {o.name: k for k, e in enumerate(fwd) for o in e.outputs}
    root = roots(g)
    is_view = {o.name: a is not None for e in fwd for o, a in zip(e.outputs, aliases(e))}
    var = {o.name: o for e in fwd for o in e.outputs}

    # Views own no memory and cost nothing to redo (apply.py recomputes them freely): every var
    # stands for the storage it lives in, its root, and only equations that allocate are choices.
    def storage(x: str) -> str | None:
        r = root.get(x, x)
        return r if r in producer and not is_view.get(r, False) else None

    first_direct: dict[str, int] = {}
    last_direct: dict[str, int] = {}
    for j, e in enumerate(bwd):
        for x in e.inputs:
            r = storage(x.name)
            if r is not None:
                first_direct.setdefault(r, j)
                last_direct[r] = j
    direct = set(first_direct)
    # every storage a recomputation of something the backward reads could need
    needed = set(direct)
    consumers: dict[str, list[int]] = {}             # storage -> equations that read it
    for k in reversed(range(len(fwd))):
        if any(o.name in needed for o in fwd[k].outputs):
            needed.update(r for x in fwd[k].inputs if (r := storage(x.name)) is not None)
    eqns = sorted({producer[n] for n in needed})
    pos = {k: p for p, k in enumerate(eqns)}
    for p_, k in enumerate(eqns):
        for r in dict.fromkeys(storage(x.name) for x in fwd[k].inputs):
            if r is not None:
                consumers.setdefault(r, []).append(p_)
    values = [o.name for k in eqns for o in fwd[k].outputs if o.name in needed and o.dtype is not None]
    vpos = {n: i for i, n in enumerate(values)}
    nK, nV = len(eqns), len(values)

    cost = np.zeros(nK + 2 * nV)
    flops = np.zeros(nK + 2 * nV)
    for p, k in enumerate(eqns):
        e = fwd[k]
        c = eqn_cost(e, device)
        never = e.op.has(Tag.RANDOM) or e.op.has(Tag.INPLACE) or not e.outputs
        cost[p] = np.inf if never else c.seconds
        flops[p] = c.flops
    vbytes = np.array([L.nbytes(var[n]) for n in values], dtype=np.float64)
    for i in range(nV):
        cost[nK + nV + i] = 2 * vbytes[i] / device.host_bw if (offload and device.host_bw) else np.inf

    def avail(x: str) -> list[tuple[int, float]]:
        return [(pos[producer[x]], 1.0), (nK + vpos[x], 1.0), (nK + nV + vpos[x], 1.0)]

    rows = []
    for x in sorted(direct, key=lambda n: (producer[n], n)):
        rows.append((avail(x), 1.0, np.inf))             # the backward reads x: it is available
    for x, readers in consumers.items():
        for q in readers:
            rows.append((avail(x) + [(q, -1.0)], 0.0, np.inf))       # recomputing q needs x
    # nothing is kept for nobody: a save, offload or recomputation needs a direct read or a recomputed reader
    for p_, k in enumerate(eqns):
        outs = [o.name for o in fwd[k].outputs]
        if any(o in direct for o in outs):
            continue
        rows.append(([(p_, 1.0)] + [(q, -1.0) for o in outs for q in consumers.get(o, ())], -np.inf, 0.0))
    for i, n in enumerate(values):
        if n in direct:
            continue
        rows.append(([(nK + i, 1.0), (nK + nV + i, 1.0)] + [(q, -1.0) for q in consumers.get(n, ())],
                     -np.inf, 0.0))

    # time: the forward program that saves nothing, then the backward with free forward inputs
    alone = apply_plan(joint, saved=(), recomputed=(), backward=False)
    tf = L.simulate(alone.forward, device=device.name)
    tb = _backward_alone(joint, producer, device.name)
    nF = len(tf.during)
    base = np.concatenate([np.array(tf.during, dtype=np.float64),
                           np.array(tb.during, dtype=np.float64) + tf.end])
    fidx = {o.name: i for i, e in enumerate(alone.forward.eqns) for o in e.outputs}
    flast = dict(L.last_uses(alone.forward))
    aroot = roots(alone.forward)
    for n, i in list(flast.items()):                 # a storage lives while any of its views does
        r = aroot.get(n)
        if r is not None and r != n:
            flast[r] = max(flast.get(r, -1), i)
    outputs = {o.name for o in alone.forward.outputs if hasattr(o, "name")}
    save_start = []
    for n in values:
        if n in outputs:
            save_start.append(nF)                    # alive anyway
        elif n in fidx:                              # computed by the forward anyway: kept from its death on
            save_start.append(max(flast.get(n, fidx[n]), fidx[n]) + 1)
        else:                                        # computed only to be saved: counted from the end
            save_start.append(nF - 1)
    needs = Needs(nF, lead, eqns, [[o.name for o in fwd[k].outputs] for k in eqns],
                  [[float(L.nbytes(o)) if o.dtype is not None else 0.0 for o in fwd[k].outputs] for k in eqns],
                  consumers, first_direct, last_direct, values, [[n] for n in values], vbytes, save_start)
    names = [fwd[k].outputs[0].name if fwd[k].outputs else f"eqn{k}" for k in eqns]
    problem = IlpProblem(eqns, names, values, vbytes, np.array([pos[producer[n]] for n in values], dtype=np.int64),
                         cost, flops, rows, base, nF)
    needs.place(problem, frozenset())
    return problem, needs


def host_limit(p: IlpProblem, capacity: float | None) -> IlpProblem:
    """p with its offloaded bytes held within `capacity` (bytes of host memory per rank): one row over
    the offload variables o[v] = x[nK + nV + v], weighted by each value's bytes. None: no limit; 0
    forbids offloading outright (so that even a value of no bytes stays: the plan is the no-offload one)."""
    nK, nV = len(p.eqns), len(p.values)
    cols = [nK + nV + i for i in range(nV) if not np.isinf(p.cost[nK + nV + i])]
    if capacity is None or not cols:
        return p
    if capacity <= 0:
        cost = p.cost.copy()
        cost[nK + nV:] = np.inf
        return replace(p, cost=cost)
    row = ([(j, float(p.value_bytes[j - nK - nV])) for j in cols], -np.inf, float(capacity))
    return replace(p, rows=p.rows + [row])


def _backward_alone(joint: Joint, producer, device: str) -> L.Timeline:
    """The backward's own bytes: the forward values it reads are inputs that are not counted."""
    from autosp.ir.core import Graph, Role, Var
    g = joint.graph
    seen = {}
    for e in joint.backward_eqns:
        for x in e.inputs:
            if x.name in producer:
                seen[x.name] = Var(x.name, x.dtype, x.shape, x.device, role=Role.INPUT)
    tangents = list(g.inputs[joint.n_primals:])
    bg = Graph(tuple(g.inputs[:joint.n_primals]) + tuple(seen.values()) + tuple(tangents),
               tuple(joint.backward_eqns), tuple(g.outputs[joint.n_fwd_outputs:]), consts=g.consts,
               name="backward-alone")
    return L.simulate(bg, counted={v.name for v in tangents}, device=device)

"""Plan the memory of a training step: the ILP's answer as data, and the programs it yields.

    plan, program = make_plan(joint, budget=0.3, device=device_for("cpu"))
    print(plan)            # per template value: save / recompute / offload, bytes, FLOPs; totals
    plan.peak_bytes        # the rewritten step simulated (liveness.py), per rank

`budget` is a fraction of the no-remat peak (a float), or bytes (an int, or "20GiB");
`host_memory` (bytes per rank) caps what offloading may put in host memory. The problem
(problem.py) is solved (solve.py); the plan is applied (apply.py) and the program simulated.
Where the simulation exceeds the budget (the model places recomputations by their first need,
the program by dependency order), the ILP is solved again under a budget lowered by the
excess. An infeasible budget raises AutospError with the smallest one (and, when host memory
is what runs out, the host memory a plan within the budget needs).
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from autosp.errors import AutospError
from autosp.ir.core import Var
from autosp.passes.autodiff import Joint
from autosp.remat import liveness as L
from autosp.remat.apply import Program, apply_plan, host_name
from autosp.remat.cost import Device, eqn_cost
from autosp.remat.cuts import activations, checkpoint_plans, with_narrow
from autosp.remat.problem import IlpProblem, Needs, build, host_limit
from autosp.remat.solve import Infeasible, solve
from autosp.remat.template import tie, untie, variable_classes
from autosp.units import fmt_bytes as _fmt  # api.py's explain reads it from here too


class BudgetError(AutospError):
    """The memory budget cannot be met by any plan; `least_peak_bytes` is the smallest peak one reaches."""

    def __init__(self, message: str, least_peak_bytes: int | None = None):
        super().__init__(message)
        self.least_peak_bytes = least_peak_bytes


@dataclass(frozen=True, slots=True)
class Decision:
    name: str            # the forward value (its storage)
    action: str          # "save" | "recompute" | "offload"
    op: str
    type: str            # printed type, e.g. f32[2,512,256]
    bytes: int
    flops: int           # recomputation FLOPs (0 unless recomputed)
    seconds: float       # modelled recompute time, or the transfer's to host and back


@dataclass(frozen=True, slots=True)
class StepMemory:
    forward: L.Timeline
    backward: L.Timeline

    @property
    def peak(self) -> int:
        return max(self.forward.peak, self.backward.peak)


@dataclass(frozen=True)
class Plan:
    decisions: tuple[Decision, ...]
    peak_bytes: int                  # simulated per-rank peak of the rewritten step
    no_remat_peak_bytes: int         # the same with every needed value saved
    budget_bytes: int | None
    least_peak_bytes: int | None     # the smallest peak a plan reaches (when it was needed)
    recompute_flops: int
    recompute_seconds: float
    offload_bytes: int
    device: str
    offload_seconds: float = 0.0         # the host transfers' modelled time (out and back, on a side stream)
    host_memory_bytes: int | None = None     # the host capacity per rank the plan was held to (None: no limit)
    tiling: tuple[tuple[str, int, int, int], ...] = ()   # (chain, k tiles, widest value whole, per tile)
    method: str = "ILP"                  # how it was found: the ILP, per-layer checkpointing (cuts.py), no remat
    stored: str | None = None            # the plan cache's file it was read from (store.py); None: planned here
    attention_backward: str = "sdpa"     # the attention backward's kernel: SDPA's backend, or autosp's
                                         # (passes/attention_backward.py)
    const_bytes: int = 0                 # the programs' constants (tensors the trace made: a lightning attention's
                                         # decay table, a captured buffer), held by the step from its compile on

    @property
    def saved_bytes(self) -> int:
        return sum(d.bytes for d in self.decisions if d.action == "save")

    def __str__(self) -> str:
        rows = Counter()
        info = {}
        for d in self.decisions:
            key = (d.action, d.op, d.type)
            rows[key] += 1
            info[key] = d
        lines = [f"# remat plan ({self.device}): budget {_fmt(self.budget_bytes)}, predicted peak "
                 f"{_fmt(self.peak_bytes)} per rank (no remat {_fmt(self.no_remat_peak_bytes)}"
                 + (f", least {_fmt(self.least_peak_bytes)})" if self.least_peak_bytes else ")"),
                 f"{'action':<10} {'count':>5}  {'op':<44} {'value':<28} {'bytes each':>12} {'FLOPs each':>12}"]
        order = {"save": 0, "offload": 1, "recompute": 2}
        for key in sorted(rows, key=lambda k: (order[k[0]], -info[k].bytes, k[1])):
            d = info[key]
            lines.append(f"{d.action:<10} {rows[key]:>5}  {d.op[:44]:<44} {d.type[:28]:<28} "
                         f"{_fmt(d.bytes):>12} {d.flops:>12.3g}")
        host = ""
        if self.offload_bytes or self.host_memory_bytes is not None:
            cap = "" if self.host_memory_bytes is None else f" of {_fmt(self.host_memory_bytes)} host memory"
            host = f"{cap}, host transfers {self.offload_seconds * 1e3:.3g} ms modelled"
        if self.method != "ILP":
            lines.append(f"found by {self.method}")
        if self.attention_backward != "sdpa":
            lines.append("attention backward: autosp's kernel (autosp::sdpa_backward: no fp32 dQ, dK/dV summed per "
                         "KV head inside it), in place of SDPA's backend's, whose scratch did not fit or was higher")
        if self.stored:
            lines.append(f"read from the plan cache: {self.stored}")
        lines.append(f"totals: saved {_fmt(self.saved_bytes)}, offloaded {_fmt(self.offload_bytes)}{host}, "
                     f"recompute {self.recompute_flops:.3g} FLOPs ({self.recompute_seconds * 1e3:.3g} ms modelled)")
        for name, k, whole, tile in self.tiling:
            lines.append(f"tiled: {name} in {k} tiles along the sequence (its widest value {_fmt(whole)} whole, "
                         f"{_fmt(tile)} per tile: {_fmt(whole - tile)} less live at once)")
        return "\n".join(lines)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_host_memory(host_memory) -> int | None:
    """Bytes of host memory per rank from None (no limit), an int, or a string such as '64GiB'."""
    if host_memory is None:
        return None
    fix = "Fix: host_memory=64 * 2**30 or '64GiB' (bytes per rank; 0 offloads nothing), or None for no limit."
    if isinstance(host_memory, float) and host_memory.is_integer():
        host_memory = int(host_memory)
    if isinstance(host_memory, int) and not isinstance(host_memory, bool):
        if host_memory < 0:
            raise AutospError(f"host_memory={host_memory}: bytes cannot be negative. {fix}")
        return host_memory
    if isinstance(host_memory, str):
        try:
            kind, value = parse_budget(host_memory)
        except AutospError:
            kind = None
        if kind == "bytes":
            return int(value)
        raise AutospError(f"host_memory={host_memory!r}: not a size. {fix}")
    raise AutospError(f"host_memory={host_memory!r} ({type(host_memory).__name__}): expected bytes per rank. {fix}")


def parse_budget(budget) -> tuple[str, float]:
    """('fraction', f) or ('bytes', n) from 0.3, 6 * 2**30, '20GiB', '512 MB'; ('least', 0) from 'least'."""
    if isinstance(budget, bool) or budget is None:
        raise AutospError(f"memory_budget={budget!r}: expected a fraction of the no-remat peak (0.3) or bytes "
                          "(an int, or a string such as '20GiB').")
    if isinstance(budget, float):
        if not budget > 0:
            raise AutospError(f"memory_budget={budget}: a fraction must be positive. Fix: e.g. memory_budget=0.3.")
        return "fraction", budget
    if isinstance(budget, int):
        if budget <= 0:
            raise AutospError(f"memory_budget={budget}: bytes must be positive. Fix: e.g. memory_budget=6 * 2**30.")
        return "bytes", float(budget)
    if isinstance(budget, str) and budget.strip().lower() == "least":
        return "least", 0.0
    if isinstance(budget, str):
        m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", budget)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise AutospError(f"memory_budget={budget!r}: not a size. Fix: write it like '20GiB', '512MiB' or '6e9', "
                              "or 'least' for the least peak the planner reaches.")
        return "bytes", float(m.group(1)) * _UNITS[unit]
    raise AutospError(f"memory_budget={budget!r} ({type(budget).__name__}): expected a float fraction, an int of "
                      "bytes, or a string such as '20GiB'.")


def simulate_step(program: Program, device: str = "cpu", saved: bool = False) -> StepMemory:
    """The step's bytes over time on a `device` ('cpu', 'cuda'): the forward, then the backward with
    the forward's results live, as remat.runtime runs them (passes/schedule.py: the collectives' buffers
    counted while they are in flight). `saved`: also follow the bytes of the values the forward saves for
    the backward (on the device: an offloaded one before it leaves and once it is fetched back;
    Timeline.tracked)."""
    from autosp.passes.schedule import schedule_program
    program = schedule_program(program)             # what remat.runtime runs: collectives started early
    host = {host_name(n) for n in program.offloaded}
    track = set(program.saved) | set(program.offloaded) if saved else None
    f = L.simulate(program.forward, host=host, device=device, track=track)
    kept = list(program.saved) + sorted(host)
    tangents = [v.name for v in program.backward.inputs if v.role.value == "tangent"]
    # forward outputs that the backward does not take stay alive (the caller holds them)
    out_bytes = _distinct_bytes([o for o in program.forward.outputs[:program.n_outputs] if isinstance(o, Var)],
                                exclude=set(program.saved))
    b = L.simulate(program.backward, counted=set(kept) | set(tangents), base=out_bytes, host=host, device=device,
                   track=track)
    return StepMemory(f, b)


def const_bytes(program: Program) -> int:
    """The bytes of the programs' constants, each storage once: the compiled step holds them across steps, so a
    step's peak (what it allocates) does not count them and the run's does."""
    seen: dict[int, int] = {}
    for g in (program.forward, program.backward):
        for _, t in (g.consts if g is not None else ()):
            s = t.untyped_storage()
            seen[s._cdata] = max(seen.get(s._cdata, 0), s.nbytes())
    return sum(seen.values())


def _within(limit: int):
    """found -> whether a (x, program, peak) found by a search is within `limit` bytes with its program's constants
    (as a verdict counts them): where _least may stop."""
    return lambda found: found[2] + const_bytes(found[1]) <= limit


def _distinct_bytes(vs, exclude=()) -> int:
    seen, total = set(), 0
    for v in vs:
        if v.name in seen or v.name in exclude or v.dtype is None:
            continue
        seen.add(v.name)
        total += L.nbytes(v)
    return total


def solve_placed(problem: IlpProblem, needs: Needs, budget: float | None, *, minimize_peak: bool = False,
                 classes=None, rounds: int = 6, feasibility: bool = False, known: set[int] | None = None,
                 node_limit: int | None = None) -> np.ndarray:
    """Solve with the memory placed for the plan's own recomputations: plan -> R -> place(R) ->
    plan, until the recomputed set is stable or repeats. Returns the best self-consistent answer
    (its memory modelled with its own placement): the cheapest within budget, or the lowest peak.
    With `classes` (template.py), every member of a class makes the same choice."""
    recomputed: frozenset[int] = frozenset()
    known = set() if known is None else known       # rows hold under every placement: shared by the rounds
    seen = set()
    best = None
    for _ in range(rounds):
        needs.place(problem, recomputed)
        try:
            x = _solve_classes(problem, classes, budget, minimize_peak=minimize_peak, feasibility=feasibility,
                               known=known, node_limit=node_limit)
        except Infeasible:
            if best is not None:
                break
            raise
        nxt = problem.recomputed(x)
        needs.place(problem, nxt)
        peak = float(np.max(problem.memory(x)))
        ok = minimize_peak or peak <= budget * (1 + 1e-9)
        key = (not ok, peak if minimize_peak or not ok else problem.objective(x))
        if best is None or key < best[0]:
            best = (key, x)
        if nxt == recomputed or nxt in seen:
            break
        seen.add(recomputed)
        recomputed = nxt
    x = best[1]
    needs.place(problem, problem.recomputed(x))
    if not minimize_peak and float(np.max(problem.memory(x))) > budget * (1 + 1e-9):
        raise Infeasible()
    return x


def _solve_classes(problem: IlpProblem, classes, budget: float | None, **kw) -> np.ndarray:
    """solve(), with every member of a class (template.py) making the same choice when `classes` is given."""
    if classes is None:
        return solve(problem, budget, **kw)
    tied, cls = tie(problem, classes)
    return untie(solve(tied, budget, **kw), cls)


def make_plan(joint: Joint, budget, device: Device, *, offload: bool = False, host_memory=None,
              template: bool | None = None, refine: bool = True, search: bool = True,
              deferred: list | None = None, enough: int | None = None) -> tuple[Plan, Program]:
    """The plan for `budget` and its programs. `template`: tie identical layers (template.py);
    None ties them when the problem is large (more than 200 binaries). budget="least": the plan
    with the smallest peak found. With `refine` False the plan is any that fits, not the cheapest
    (no cost-minimising solve, the slowest kind): what the planning command's length search asks.
    `host_memory`: bytes per rank (or '64GiB') the offloaded values may take; None: no limit.
    `search` False: where the budget's solves find no plan, refuse at once, without the least-peak
    search (the tiling search asks so of the tilings it passes by). `deferred` (a list): budget="least" with
    `refine` answers the least-peak search's own plan and appends the call that makes the cheapest plan at its peak
    (the cost-minimising solve: the tiling search compares its ends by their least peaks and refines the lower
    alone). `enough` (bytes, with budget="least"): the search stops at the first plan whose simulated peak and
    constants are within it (a verdict's budget: whether the least is within it is all it asks, and the least is at
    most that plan's peak)."""
    host = parse_host_memory(host_memory)
    host = host if offload else None              # without a host link nothing is offloaded anyway
    unlimited, needs = build(joint, device, offload=offload)
    problem = host_limit(unlimited, host)
    if template is None:
        template = problem.n_bin > 200
    classes = variable_classes(problem, joint.forward_eqns) if template else None
    inf = float("inf")
    full_x = solve_placed(problem, needs, inf, classes=classes)
    full = _program(joint, problem, full_x)
    no_remat = simulate_step(full, device.name).peak
    if budget is None:
        return _describe(problem, joint, full_x, full, no_remat, None, None, device, host, peak=no_remat), full
    kind, amount = parse_budget(budget)

    def simulated(x):
        prog = _program(joint, problem, x)
        return prog, simulate_step(prog, device.name).peak

    found = []

    def seeds():                        # per-layer checkpointing at the cuts (cuts.py): the least search's start
        found[:] = checkpoint_plans(problem, needs, activations(joint), host)
        return found

    def narrow(how, x):                 # the best seed, keeping the narrow joins of tiles its backward reads too
        joins = {o.name for e in joint.forward_eqns if e.op.name.split(".")[0] == "cat" for o in e.outputs}
        y = with_narrow(problem, needs, activations(joint), joins, x, host)
        if y is None:
            return None
        found.append((f"{how}, and the narrow joins of tiles", y))
        return y

    if kind == "least":
        # refine False asks for a peak (the planning command's length search): a coarser search
        within = None if enough is None else _within(enough)
        least = _least(problem, needs, classes, simulated, no_remat, full_x, full, tol=0.005 if refine else 0.02,
                       seeds=seeds(), narrow=narrow, stop=within)

        def described(least):
            x, prog, peak = least
            how = "saving everything" if x is full_x else _method(x, found)     # `enough` at or above no remat
            return _describe(problem, joint, x, prog, no_remat, int(peak), int(peak), device, host, how,
                             peak=peak), prog
        if refine and deferred is not None:
            deferred.append(lambda: described(_cheapest_at(problem, needs, classes, simulated, least)))
        elif refine:
            least = _cheapest_at(problem, needs, classes, simulated, least)
        return described(least)
    target = amount * no_remat if kind == "fraction" else amount
    if target >= no_remat:
        return _describe(problem, joint, full_x, full, no_remat, int(target), None, device, host,
                         peak=no_remat), full

    model_budget = target
    best = None
    known: set[int] = set()             # the memory rows these solves needed: each starts from the others'
    for _ in range(6):
        try:
            x = solve_placed(problem, needs, model_budget, classes=classes, feasibility=not refine, known=known)
        except Infeasible:
            break
        prog, peak = simulated(x)
        obj = problem.objective(x)
        if peak <= target and (best is None or obj < best[3]):
            best = (x, prog, peak, obj)
        if peak <= target:
            break
        model_budget -= (peak - target) + 0.002 * target
    least_peak = None
    if best is None and not search:
        raise BudgetError(f"autosp remat: memory_budget={budget!r} ({_fmt(target)} per rank): the budget's solves "
                          "found no plan (the least-peak search was not asked for).")
    if best is None:
        # the search of memory_budget="least" (_least: per-layer checkpointing, peak-minimising MIPs and a
        # bisection, judged by simulation; its own rows), stopped at its first plan within the budget with the
        # programs' constants (as a verdict stops: the least it would go on to is lower still); refused, it ran
        # whole, and its least is said
        least = _least(problem, needs, classes, simulated, no_remat, full_x, full, seeds=seeds(), narrow=narrow,
                       stop=_within(target))
        least_peak = least[2]
        if least_peak <= target:
            least_peak = None
            if refine:
                least = _cheapest_at(problem, needs, classes, simulated, least)
        else:
            short = _host_shortfall(problem, unlimited, needs, classes, simulated, least[0], host, target)
            held = f" within host_memory={host} bytes per rank ({_fmt(host)})" if host is not None else ""
            why = (f" Host memory runs out: a plan within the budget offloads {short} bytes ({_fmt(short)}) per "
                   f"rank. Fix: host_memory={short} or more per rank, " if short else " Fix: ")
            raise BudgetError(
                f"autosp remat: memory_budget={budget!r} ({_fmt(target)} per rank) is below the smallest peak the "
                f"planner reaches{held}, {least_peak} bytes ({_fmt(least_peak)}, {least_peak / no_remat:.3f} of the "
                f"no-remat peak {_fmt(no_remat)}).{why}memory_budget={least_peak} or more (a fraction >= "
                f"{least_peak / no_remat:.3f}), or more sequence-parallel ranks.", least_peak_bytes=int(least_peak))
        best = least + (problem.objective(least[0]),)
    x, prog = best[0], best[1]
    return _describe(problem, joint, x, prog, no_remat, int(target), least_peak, device, host,
                     _method(x, found), peak=best[2]), prog


def _method(x, seeds) -> str:
    """How the plan `x` was found: by which of the `seeds` (cuts.py) it is, else by the ILP."""
    return next((how for how, y in seeds if np.array_equal(np.asarray(x), y)), "ILP")


def _offloaded_bytes(p: IlpProblem, x) -> float:
    nK, nV = len(p.eqns), len(p.values)
    x = np.asarray(x)
    return float(np.sum(p.value_bytes * ((x[nK + nV:nK + 2 * nV] > 0.5) & (x[nK:nK + nV] < 0.5))))


def _host_shortfall(problem, unlimited, needs, classes, simulated, least_x, host, target) -> int | None:
    """When a budget is refused under a host capacity: the host bytes per rank a plan within the budget
    offloads, if host memory is what holds it back, else None. Only asked when the least plan leaves no
    room in host memory for another offloadable value (with templates, the values of its class, which
    go together: the cheap test), then confirmed by feasibility solves without the limit."""
    if host is None:
        return None
    nK, nV = len(unlimited.eqns), len(unlimited.values)
    room = host - _offloaded_bytes(problem, least_x)
    x = np.asarray(least_x)
    cls = np.asarray(classes) if classes is not None else np.arange(unlimited.n_bin)
    together = {}                                # class -> bytes its offload variables move together
    for i in range(nV):
        c = int(cls[nK + nV + i])
        together[c] = together.get(c, 0.0) + float(unlimited.value_bytes[i])
    if not any(not np.isinf(unlimited.cost[nK + nV + i]) and x[nK + nV + i] < 0.5
               and together[int(cls[nK + nV + i])] > room for i in range(nV)):
        return None
    model_budget = target
    for _ in range(4):        # as make_plan's loop: lowered by the simulation's excess, or (the placement
        try:                  # iteration is not monotone in the budget) by 5 % where a solve finds nothing
            y = solve_placed(unlimited, needs, model_budget, classes=classes, feasibility=True)
        except Infeasible:
            model_budget -= 0.05 * target
            continue
        peak = simulated(y)[1]
        if peak <= target:
            return int(_offloaded_bytes(unlimited, y))
        model_budget -= (peak - target) + 0.002 * target
    return None


def _least(problem, needs, classes, simulated, no_remat, full_x, full, tol: float = 0.005, rounds: int = 2,
           seeds=(), narrow=None, stop=None):
    """(x, program, peak) of the lowest simulated peak found: `seeds` (assignments: per-layer
    checkpointing at the program's cuts, cuts.py), then peak-minimising MIPs with the memory
    placed for a set of recomputations (none, then each answer's own, `rounds` times); where they
    beat the seeds (or there are none), a bisection on the budget below the lowest so far
    (feasibility solves, each placed for its own plan's recomputations: cautious, but
    self-consistent), then the MIPs again from the bisection's set.
    The placement is a model: an answer that recomputes other equations may peak elsewhere, so the
    simulation of each answer's program judges, and the lowest is kept. Every solve starts from the
    memory rows the others needed (a row holds at every budget and placement). Deterministic: the
    same search wherever it is asked. `stop(found)`: true ends the search at that plan, in the search's own order (no
    remat, the seeds, the MIPs' answers, the bisection's plans): a plan within a budget (make_plan's `enough`, or the
    budget whose solves found none), which the least the whole search would find is at most."""
    known: set[int] = set()
    best = (full_x, full, no_remat)
    best_how = None

    within = stop or (lambda found: False)
    if within(best):                    # saving everything is within it
        needs.place(problem, problem.recomputed(full_x))
        return best
    for how, x in seeds:
        prog, peak = simulated(x)
        if peak < best[2]:
            best, best_how = (x, prog, peak), how
            if within(best):
                needs.place(problem, problem.recomputed(x))
                return best
    y = narrow(best_how, best[0]) if narrow is not None and best_how is not None else None
    if y is not None:                   # the best seed keeping the narrow values too (cuts.with_narrow)
        prog, peak = simulated(y)
        if peak < best[2]:
            best = (y, prog, peak)
            if within(best):
                needs.place(problem, problem.recomputed(y))
                return best
    seeded = best
    best = _descend(problem, needs, classes, simulated, best, frozenset(), rounds, known, within)
    if (best is seeded and seeded[0] is not full_x) or within(best):
        # per-layer checkpointing beat the MIPs: the bisection, which refines the MIPs' model below their
        # answer, found nothing lower in any problem measured (bench/RESULTS.md) and took seconds
        needs.place(problem, problem.recomputed(best[0]))
        return best
    bisected = _bisect(problem, needs, classes, simulated, best, tol, known, within)
    if bisected[2] < best[2]:
        best = bisected if within(bisected) else _descend(problem, needs, classes, simulated, bisected,
                                                          problem.recomputed(bisected[0]), rounds, known, within)
    needs.place(problem, problem.recomputed(best[0]))
    return best


def _descend(problem, needs, classes, simulated, best, placed, rounds, known, stop=lambda found: False):
    """The best of `best` and the peak-minimising MIPs placed for `placed`, then for each answer's set,
    while they beat `best`: a first answer above it (per-layer checkpointing's, on every model planned
    at scale) was never beaten by the next round's (bench/RESULTS.md), which cost a second of HiGHS. `stop(found)`:
    true ends the descent at that answer (_least's `enough`)."""
    seen = set()
    for _ in range(rounds):
        needs.place(problem, placed)
        try:
            x = _solve_classes(problem, classes, None, minimize_peak=True, known=known, gap=LEAST_GAP)
        except Infeasible:
            break
        prog, peak = simulated(x)
        if peak >= best[2]:
            break
        best = (x, prog, peak)
        nxt = problem.recomputed(x)
        if nxt == placed or nxt in seen or stop(best):
            break
        seen.add(placed)
        placed = nxt
    return best


LEAST_GAP = 0.05    # the peak-minimising MIPs stop within 5 %: the placement's error is larger than that


def _bisect(problem, needs, classes, simulated, best, tol, known, stop=lambda found: False):
    """(x, program, peak): `best` or a lower peak found by bisection on the budget below it, down to
    the tolerance `tol` of the peak (feasibility solves, each placed for its own recomputations); `stop(found)`
    true ends it at that plan."""
    lo, hi = float(np.max(problem.base)), float(best[2])
    while hi - lo > tol * hi:
        mid = (lo + hi) / 2
        try:
            x = solve_placed(problem, needs, mid, classes=classes, feasibility=True, known=known,
                             node_limit=BISECT_NODES)
        except Infeasible:
            lo = mid
            continue
        prog, peak = simulated(x)
        if peak < best[2]:
            best = (x, prog, peak)
            if stop(best):
                break
        hi = min(mid, peak) if peak <= mid else mid
    return best


BISECT_NODES = 50   # a budget whose feasibility is not settled within 50 nodes counts as too low: near the
                    # least, proving a budget infeasible took seconds (tiny's plan: 2.5 s) and found nothing


def _cheapest_at(problem, needs, classes, simulated, least):
    """The cheapest plan at the least peak found (only when it is used: a refused budget needs the
    peak alone, and this cost-minimising solve is the slowest of the search)."""
    x, prog, peak = least
    try:
        y = solve_placed(problem, needs, float(peak), classes=classes)
        prog_y, peak_y = simulated(y)
        if peak_y <= peak:
            return (y, prog_y, peak_y)
    except Infeasible:
        pass
    return least


def _program(joint: Joint, p: IlpProblem, x) -> Program:
    x = np.asarray(x)
    nK, nV = len(p.eqns), len(p.values)
    recomputed = [p.eqns[i] for i in range(nK) if x[i] > 0.5]
    saved = [p.values[i] for i in range(nV) if x[nK + i] > 0.5]
    offloaded = [p.values[i] for i in range(nV) if x[nK + nV + i] > 0.5 and x[nK + i] < 0.5]
    return apply_plan(joint, saved, recomputed, offloaded)


def _describe(p: IlpProblem, joint: Joint, x, program: Program, no_remat, target, least, device,
              host: int | None = None, method: str = "ILP", peak: int | None = None) -> Plan:
    """The Plan of `program` (`peak`: its simulated peak, where the caller has it)."""
    fwd = joint.forward_eqns
    nK, nV = len(p.eqns), len(p.values)
    by_name = {o.name: (k, o) for k, e in enumerate(fwd) for o in e.outputs}
    recomputed = set(program.backward.eqns) & set(fwd)
    recomputed_eqns = [e for e in program.backward.eqns if e in recomputed]
    decisions = []
    for i, n in enumerate(p.values):
        k, o = by_name[n]
        e = fwd[k]
        if n in program.saved:
            act = "save"
        elif n in program.offloaded:
            act = "offload"
        elif e in recomputed:
            act = "recompute"
        else:
            continue
        c = p.cost[p.value_eqn[i]] if act == "recompute" else (p.cost[nK + nV + i] if act == "offload" else 0.0)
        fl = int(p.flops[p.value_eqn[i]]) if act == "recompute" else 0
        decisions.append(Decision(n, act, e.op.name, o.type_str(), L.nbytes(o), fl, float(c)))
    rflops = sum(eqn_cost(e, device).flops for e in recomputed_eqns)
    rsec = sum(eqn_cost(e, device).seconds for e in recomputed_eqns)
    peak = simulate_step(program, device.name).peak if peak is None else peak
    offloaded = [d for d in decisions if d.action == "offload"]
    return Plan(tuple(decisions), int(peak), int(no_remat), target, least, int(rflops), float(rsec),
                sum(d.bytes for d in offloaded), device.name, float(sum(d.seconds for d in offloaded)), host,
                method=method, const_bytes=const_bytes(program))

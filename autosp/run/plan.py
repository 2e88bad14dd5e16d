"""`autosp plan`: the longest sequence each rank can train, from the memory model; nothing runs.

For a model, a mesh (sp, dp) and a memory size per rank it answers for three configurations:
no sequence parallelism (the single-device program on every rank), SP without remat, and SP with
autosp's ILP plan (save / recompute, and offload under the GPU cost model). Per rank it counts:

    parameters + optimizer state        replicated over sp and dp (autosp does not shard them)
    + the step's peak                   activations, temporaries, collective buffers and the
                                        parameters' gradients, from the liveness model of the
                                        joint forward + backward program (autosp.remat)

How the length is found without tracing at every candidate length: every value of the program is
either independent of the sequence length L or proportional to it, and the executed order does not
depend on L, so for a fixed program the bytes live at each equation are affine in L, and the peak is
the largest of those affine functions. Two meta traces (L1, L2) fix them exactly; the longest L is
then solved for, per equation. The ILP plan changes with L, so its least reachable peak at L1 and L2
gives an estimate that is checked by a third trace at the answer: a plan must fit there (else the
estimate is corrected by a secant step and checked again). Only peaks are asked for: the least peak
with no cheapest-plan solve after it, and at the check any plan that fits (feasibility solves), so the
row's traffic is that plan's, not the cheapest's. The third trace also re-checks the affine model of
the no-remat program.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from autosp.errors import AutospError
from autosp.run.meshes import fake_world, planning_mesh
from autosp.run.models import build_model, count_parameters, describe, model_config

_OPT_BYTES = {"adamw": 8, "sgd": 0}          # optimizer state per parameter: AdamW's 2 fp32 moments
_COLLECTIVES = ("all_to_all", "all_reduce_sum", "all_gather_seq")


def fmt(n: float) -> str:
    if n is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def parse_memory(text: str) -> int:
    from autosp.remat import parse_budget
    try:
        kind, value = parse_budget(text)
    except AutospError:
        kind = None
    if kind != "bytes":
        raise AutospError(f"--memory {text}: not a size. Fix: write the memory per rank like 80GiB, 141GB or 24e9.")
    return int(value)


# ---------------------------------------------------------------- programs at one length

@dataclass
class Programs:
    """A model traced and sharded at one length: its global (no SP) and per-rank (SP) graphs."""
    length: int
    graph: object
    local: object


class Tracer:
    """Meta traces of one model on one planning mesh, at any length."""

    def __init__(self, spec, mesh, dtype, batch: int, sp: int):
        self.sp = sp
        self.model = build_model(spec, device="meta", dtype=dtype)
        self.params = {k: v.detach().requires_grad_(True) for k, v in self.model.named_parameters()}
        self.mesh, self.batch = mesh, batch
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.params.values())
        self.n_params = count_parameters(self.model)

    def loss_fn(self, params, input_ids, labels):
        return torch.func.functional_call(self.model, params, (input_ids,), {"labels": labels}).loss

    def trace(self, length: int) -> Programs:
        import autosp
        ids = torch.zeros(self.batch, length, dtype=torch.long, device="meta")
        graph, local = autosp.shard(self.loss_fn, self.mesh).graphs(self.params, ids, ids)
        return Programs(length, graph, local)


def _step(graph, budget, device: str, offload: bool = False, refine: bool = True):
    """(Plan, Program) of one training step of `graph` under `budget` (None: no remat; "least": the
    plan with the least peak found), through the planning entry autosp.plan uses. refine=False: any
    plan that fits, for the length search, which reports peaks."""
    from autosp.remat import plan_step
    plan, program, _, _ = plan_step(graph, budget, device=device, offload=offload, refine=refine)
    return plan, program


def _profile(program, device: str) -> tuple[np.ndarray, int]:
    """The bytes live at every point of the simulated step on `device`, and a hash of the program's shape."""
    from autosp.remat import simulate_step
    mem = simulate_step(program, device)
    values = []
    for t in (mem.forward, mem.backward):
        values += [t.start, *t.during, t.end]
    shape = hash(tuple(e.op.name for g in (program.forward, program.backward) for e in g.eqns))
    return np.asarray(values, dtype=np.float64), shape


@dataclass
class Probe:
    """What one length tells: each no-remat program's memory profile and collective bytes, and the
    least peak a plan reaches with SP (picklable: it may come from a forked process)."""
    length: int
    profiles: dict          # config -> (values, shape hash, collective bytes)
    least: int


def probe(tracer, length: int, device: str, offload: bool) -> Probe:
    p = tracer.trace(length)
    profiles = {}
    for key, graph, ranks in (("nosp", p.graph, 1), ("sp", p.local, tracer.sp)):
        _, program = _step(graph, None, device)
        values, shape = _profile(program, device)
        profiles[key] = (values, shape, comm_bytes(program, ranks))
    return Probe(length, profiles, _step(p.local, "least", device, offload, refine=False)[0].peak_bytes)


def _both(first, second, parallel: bool = True):
    """first() here and second() in a forked child at the same time (planning is single-threaded
    Python; a second core halves it); sequential where fork is not available."""
    import os
    import pickle
    if not parallel or not hasattr(os, "fork"):
        return first(), second()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                      # the child: compute, send, leave without cleanup
        code = 0
        try:
            os.close(r)
            try:
                out = ("ok", second())
            except BaseException as exc:  # noqa: BLE001 - sent to the parent, raised there
                out = ("error", exc)
            data = pickle.dumps(out)
            with os.fdopen(w, "wb") as f:
                f.write(data)
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    try:
        a = first()
    finally:
        with os.fdopen(r, "rb") as f:
            data = f.read()
        os.waitpid(pid, 0)
    if not data:
        raise AutospError("autosp plan: the planning subprocess died. Fix: rerun; if it persists, report it.")
    status, b = pickle.loads(data)
    if status == "error":
        raise b
    return a, b


def comm_bytes(program, sp: int) -> int:
    """Bytes each rank sends in the step's collectives: all-to-all (P-1)/P of its input, ring
    all-reduce 2(P-1)/P, all-gather (P-1) times its chunk (recomputed collectives included)."""
    if sp <= 1:
        return 0
    total = 0.0
    for g in (program.forward, program.backward):
        for e in g.eqns:
            name = e.op.name.split(".")[0]
            if name not in _COLLECTIVES:
                continue
            size = sum(v.nbytes() for v in e.inputs)
            total += {"all_to_all": (sp - 1) / sp, "all_reduce_sum": 2 * (sp - 1) / sp,
                      "all_gather_seq": sp - 1}[name] * size
    return int(total)


def ring_allreduce_bytes(nbytes: int, n: int) -> int:
    return int(2 * (n - 1) / n * nbytes) if n > 1 else 0


@dataclass
class Affine:
    """Bytes live at each point of a fixed program as a + b L (exact for these programs)."""
    a: np.ndarray
    b: np.ndarray

    @classmethod
    def fit(cls, l1: int, v1: np.ndarray, l2: int, v2: np.ndarray) -> Affine:
        b = (v2 - v1) / (l2 - l1)
        return cls(v1 - b * l1, b)

    def peak(self, length: int) -> float:
        return float(np.max(self.a + self.b * length))

    def longest(self, avail: float, step: int) -> int:
        """The largest multiple of `step` whose peak is at most `avail` (0 if none)."""
        grow = self.b > 0
        if np.any(self.a[~grow] > avail):
            return 0
        if not np.any(grow):
            return 1 << 62
        cap = float(np.min((avail - self.a[grow]) / self.b[grow]))
        n = int(math.floor(cap / step + 1e-9)) * step
        while n > 0 and self.peak(n) > avail:
            n -= step
        return max(n, 0)


def _guess(cfg, avail: float, dtype, sp: int, batch: int) -> float:
    """A rough SP no-remat length for `avail` bytes (a textbook count of a Llama layer's saved
    activations), only to place the two probe lengths near the answers; nothing depends on its accuracy."""
    h, n = cfg.hidden_size, cfg.num_hidden_layers
    f = getattr(cfg, "intermediate_size", 4 * h)
    per_token = (dtype.itemsize * n * (10 * h + 3 * f) + 12 * cfg.vocab_size) * batch / sp
    return max(0.0, avail) / per_token


def _rounded(x: float, step: int) -> int:
    return int(x // step) * step


@dataclass
class Row:
    name: str
    length: int
    peak: float | None              # the step's peak at that length (per rank)
    comm: int | None
    note: str = ""


def _line(a: float, l1: int, b: float, l2: int):
    """The affine function through (l1, a) and (l2, b)."""
    return Affine.fit(l1, np.array([a], dtype=np.float64), l2, np.array([b], dtype=np.float64))


def plan_lengths(model: str, *, sp: int, dp: int = 1, memory: str, dtype: str = "bfloat16", optimizer: str = "adamw",
                 batch: int = 1, device: str = "cuda", offload: bool = False, granularity: int | None = None,
                 parallel: bool = True) -> str:
    """The report of `autosp plan` (see the module docstring). `parallel`: probe the two lengths in two
    processes (a fork; pass False in a process whose threads make forking unsafe)."""
    t_start = time.perf_counter()
    mem = parse_memory(memory)
    step = granularity or sp * 64
    if step % sp:
        raise AutospError(f"--granularity {step}: lengths must split over sp={sp} ranks. Fix: a multiple of {sp}.")
    if offload and device != "cuda":
        raise AutospError("--offload: offloading is planned for a GPU's host link. Fix: --device cuda, or leave "
                          "--offload out.")
    spec = model_config(model)
    torch_dtype = getattr(torch, dtype)
    with fake_world(sp * dp):
        tracer = Tracer(spec, planning_mesh(sp, dp), torch_dtype, batch, sp)
        n = tracer.n_params
        p_bytes = g_bytes = tracer.param_bytes
        o_bytes = _OPT_BYTES[optimizer] * n
        out = [f"autosp plan: {describe(spec)}\n  {n / 1e9:.3f}B parameters in {dtype}; mesh dp {dp} x sp {sp}; "
               f"{fmt(mem)} per rank; cost model {device}; {batch} sequence(s) per dp rank",
               f"model state per rank (replicated over sp and dp): parameters {fmt(p_bytes)}, gradients "
               f"{fmt(g_bytes)} (counted in the step's peak), {optimizer} "
               + (f"2 fp32 moments {fmt(o_bytes)}" if o_bytes else "no state")
               + f" = {fmt(p_bytes + g_bytes + o_bytes)}"]
        state = p_bytes + g_bytes + o_bytes
        if state >= mem:
            out.append(f"-> the model state alone needs {fmt(state)}, {fmt(state - mem)} more than the {fmt(mem)} per "
                       "rank: no sequence length fits in any configuration. Fix: more memory per rank"
                       + (", --optimizer sgd" if optimizer != "sgd" else "")
                       + ", a smaller model, or parameters and optimizer sharded over dp (not part of autosp).")
            return "\n".join(out)
        fixed = p_bytes + o_bytes                          # live across the step; the step's peak adds the rest
        avail = mem - fixed

        def tokens(length):                                 # the token ids (labels are the same tensor)
            return 8 * batch * length

        l1 = max(32 * step, _rounded(_guess(spec.config, avail - g_bytes, torch_dtype, sp, batch), step))
        l2 = 4 * l1
        q1, q2 = _both(lambda: probe(tracer, l1, device, offload), lambda: probe(tracer, l2, device, offload),
                       parallel)

        rows, models = [], {}
        for key, name, ranks in (("nosp", "no SP", 1), ("sp", f"SP={sp}, no remat", sp)):
            (v1, s1, c1), (v2, s2, c2) = q1.profiles[key], q2.profiles[key]
            if s1 != s2 or len(v1) != len(v2):
                raise AutospError(f"autosp plan: {model}'s program differs between lengths {l1} and {l2}, so its "
                                  "memory cannot be solved for in closed form. Fix: plan with autosp.plan at the "
                                  "lengths you need (the Python API).")
            aff = models[key] = Affine.fit(l1, v1 + tokens(l1), l2, v2 + tokens(l2))
            length = aff.longest(avail, step)
            comm = int(_line(c1, l1, c2, l2).peak(length)) if length else None
            rows.append(Row(name, length, aff.peak(length) if length else None, comm))

        # SP with the ILP plan: the least peak at l1 and l2 gives an estimate; a trace there checks it
        from autosp.remat import BudgetError
        least = [(l1, q1.least + tokens(l1)), (l2, q2.least + tokens(l2))]
        floor_len = rows[1].length
        guess = _line(least[0][1], l1, least[1][1], l2).longest(avail, step)
        checked, tries = None, 0
        while tries < 4:
            tries += 1
            guess = max(guess, floor_len + step)
            pg = tracer.trace(guess)
            try:
                plan, prog = _step(pg.local, int(avail - tokens(guess)), device, offload, refine=False)
            except BudgetError as exc:
                least.append((guess, exc.least_peak_bytes + tokens(guess)))
                below = [p for p in least if p[0] < guess]
                ref = max(below) if below else least[0]
                guess = min(_line(ref[1], ref[0], least[-1][1], guess).longest(avail, step), guess - step)
                if guess <= floor_len:
                    break
                continue
            checked = (guess, plan, prog, pg)
            break
        name = f"SP={sp}, ILP plan (save/recompute{'/offload' if offload else ''})"
        if checked is None:
            rows.append(Row(name, floor_len, rows[1].peak, rows[1].comm, "no plan fits a longer length than saving "
                                                                            "everything"))
            recheck = None
        else:
            glen, plan, prog, pg = checked
            rows.append(Row(name, glen, plan.peak_bytes + tokens(glen), comm_bytes(prog, sp),
                            f"checked by a trace at {glen:,} ({tries} trace{'s' if tries > 1 else ''}): the plan's "
                            f"peak {fmt(plan.peak_bytes)} fits the {fmt(avail - tokens(glen))} left (a longer "
                            "length was not tried: this row is a length that fits, within the estimate's error of "
                            "the longest)"
                            + (f"; it offloads {fmt(plan.offload_bytes)} to host memory per rank"
                               if plan.offload_bytes else "")))
            _, prog3 = _step(pg.local, None, device)
            v3, _ = _profile(prog3, device)
            recheck = (glen, abs(models["sp"].peak(glen) - (float(np.max(v3)) + tokens(glen))))
    dp_comm = ring_allreduce_bytes(g_bytes, dp)
    sp_grad = ring_allreduce_bytes(g_bytes, sp)

    out.append(f"longest trainable sequence (tokens per sequence, a multiple of {step}) and per-rank memory:\n")
    out.append("| configuration | longest sequence | memory per rank | of which the step's peak | "
               "collectives sent per rank per step |")
    out.append("|---|---|---|---|---|")
    for r in rows:
        grads = dp_comm + (sp_grad if r.name != "no SP" else 0)
        if r.length:
            out.append(f"| {r.name} | {r.length:,} | {fmt(fixed + r.peak)} | {fmt(r.peak)} | "
                       f"{fmt((r.comm or 0) + grads)} ({fmt(r.comm or 0)} sequence, {fmt(grads)} gradients) |")
        else:
            out.append(f"| {r.name} | none ({step} tokens do not fit) | - | - | - |")
    if rows[1].length and rows[2].length:
        out.append(f"\nILP plan / SP without remat: {rows[2].length / rows[1].length:.2f}x the length"
                   + (f"; SP without remat / no SP: {rows[1].length / rows[0].length:.2f}x" if rows[0].length else ""))
    out.append(f"\nhow: two meta traces (lengths {l1:,} and {l2:,}) fix each no-remat program's bytes at every "
               "point of the step as an affine function of the length, solved for exactly"
               + (f" (re-checked by the trace at {recheck[0]:,}: off by {recheck[1]:.0f} bytes)" if recheck else "")
               + f"; the ILP plan's least peak at those lengths gave an estimate, {rows[2].note or 'not needed'}.")
    out.append(f"memory per rank = parameters + optimizer state ({fmt(fixed)}) + the step's peak (activations, "
               "temporaries, collective buffers, gradients) + the token ids. Gradients are all-reduced over sp"
               + (" and dp" if dp > 1 else "") + f" by ring ({fmt(sp_grad + dp_comm)} sent per rank)."
               f" Planned in {time.perf_counter() - t_start:.0f} s.")
    return "\n".join(out)

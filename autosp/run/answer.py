"""What `autosp plan` answers and `autosp train` checks before its first step, for one Step (config.py).

    report = longest(step)       # the longest length per configuration (no SP, SP, SP with the ILP plan)
    fit = at_length(step)        # one length: fits or not, the per-rank breakdown, the step time
    said = answer(step)          # `autosp plan`'s text (either of the above), kept in the plan cache

Both count the model state one rank keeps across steps (`ModelState`), the token ids, and the step's
peak from autosp's memory model (plan.py's probes for `longest`, the plan `autosp train` will run for
`at_length`), and both end an answer that fits with the `autosp train` command that runs it.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from autosp.errors import AutospError
from autosp.run.config import PRECISIONS, RANKS_PER_NODE, Step
from autosp.run.meshes import fake_world, planning_mesh
from autosp.run.models import describe, spec_of
from autosp.run.plan import (_MOMENTS, Affine, NotAffine, Row, Tracer, _guess, _held_back, _line, _rounded, _secs,
                             _tiled_names, fmt, probe, ring_allreduce_bytes, step_seconds)


@dataclass
class ModelState:
    """The model state one rank holds through the step (bytes), and how it is laid out."""
    params: int                     # replicated: the parameters in the compute dtype; sharded: the fp32 master shard
    grads: int                      # the parameters' gradients (or gradient shard): in the step's peak
    moments: int                    # the optimizer's (0 with --optimizer-offload: on host)
    ranks: int                      # the ranks it is sharded over (1: replicated)
    host: int = 0                   # --optimizer-offload: fp32 master, gradient and moments on host

    @property
    def total(self) -> int:
        return self.params + self.grads + self.moments

    @property
    def resident(self) -> int:
        """What stays on the device across steps (the gradients are the step's, in its peak)."""
        return self.params + self.moments


def model_state(step: Step, param_bytes: int, trainable: int | None = None) -> ModelState:
    """The model state one rank keeps, from `param_bytes` (plan.master_bytes: this rank's parameters as the step
    keeps them). Replicated: parameters and gradients in the compute dtype and fp32 moments on every rank.
    Sharded (FSDP2 mixed precision, autosp.shard_params): every rank keeps 1/N of the fp32 master parameters,
    of their fp32 gradients (what reduce_scatter_param returns) and of the fp32 moments; the compute copy
    is gathered by the step (in its peak). --optimizer-offload (ZeRO-Offload): the moments, an fp32 master
    copy and an fp32 gradient copy of the rank's part live on host instead; the device keeps the parameters
    and, through the step, their gradients. `trainable`: with LoRA, the fp32 bytes of this rank's adapters
    (lora.adapter_bytes), the only parameters with a gradient and moments; `param_bytes` counts the frozen base in
    the compute dtype beside them."""
    ranks = step.world if step.sharded else 1
    itemsize = 4 if step.sharded else step.dtype.itemsize
    fp32 = param_bytes // itemsize * 4 if trainable is None else trainable   # this rank's trained part, in fp32
    grads = param_bytes if trainable is None else fp32 // 4 * itemsize
    moments = _MOMENTS[step.optimizer] * fp32
    if step.optimizer_offload:
        return ModelState(param_bytes, grads, 0, ranks, 2 * fp32 + moments)
    return ModelState(param_bytes, grads, moments, ranks)


def _state_line(st: ModelState, tracer, optimizer: str, dtype: str, dp: int, sp: int) -> str:
    if tracer.lora is not None:
        from autosp.run.lora import state_line
        return state_line(st, dtype, dp, sp)
    line = _device_state_line(st, tracer, optimizer, dtype, dp, sp)
    if st.host and not tracer.sharded:
        line += f"; the device's parameters are the {dtype} compute copy"
    if st.host:
        line += (f"; --optimizer-offload: the fp32 master copy, an fp32 gradient copy and {optimizer}'s "
                 f"{_MOMENTS[optimizer]} moments in host memory, {fmt(st.host)} per rank")
    return line


def _device_state_line(st: ModelState, tracer, optimizer: str, dtype: str, dp: int, sp: int) -> str:
    opt = (f"{optimizer} {_MOMENTS[optimizer]} fp32 moments {fmt(st.moments)}" if st.moments else
           f"{optimizer} state on host" if st.host else f"{optimizer} no state")
    if not tracer.sharded:
        return (f"model state per rank (replicated over sp and dp): parameters {fmt(st.params)}, gradients "
                f"{fmt(st.grads)} (counted in the step's peak), {opt} = {fmt(st.total)}")
    per = "4 master + 4 gradient" + (f" + {4 * _MOMENTS[optimizer]} moments" if st.moments else "")
    copy = getattr(torch, dtype).itemsize
    mixed = ", mixed precision" if copy < 4 else ""
    over = f"sharded over {st.ranks} ranks" if st.ranks > 1 else "one rank's fp32 master"
    return (f"model state per rank ({over}, dp {dp} x sp {sp}: Shard(0) as FSDP2 lays it out"
            f"{mixed}): fp32 master parameters {fmt(st.params)}, fp32 gradients {fmt(st.grads)} (counted "
            f"in the step's peak), {opt} = {fmt(st.total)}: {per} bytes per parameter over {st.ranks} ranks; the "
            f"{dtype} compute copy ({copy} bytes per parameter, {fmt(tracer.compute_bytes)} for the whole model) "
            "is gathered a layer ahead by the step and counted in its peak")


def _host_line(host: int, given: bool, world: int, offload: bool, offloaded: int | None,
               seconds: float | None = None, state: int = 0) -> str:
    """What the plan puts in host memory, per rank and per node, and its transfers' time per step."""
    per_node = min(world, RANKS_PER_NODE)
    parts = [f"{fmt(host // per_node)} per rank at {per_node} per node"] if offload or state else []
    if state:
        parts.append(f"{fmt(state)} of it the optimizer's (--optimizer-offload)"
                     + (", the rest the ILP plan's host capacity" if offload else ""))
    elif offload:
        parts[0] += " (the ILP plan's host capacity)"
    head = (f"host memory per node: {fmt(host)} ({'--host-memory' if given else 'assumed; pass --host-memory'})"
            + "".join(", " + p for p in parts) + ", counted apart from the device memory; planned on the host: ")
    if not offloaded:
        why = ("--offload lets the ILP plan move activations there" if not offload else
               "no ILP plan was made" if offloaded is None else "the ILP plan offloads nothing at its length")
        return head + f"no activations (the step stays on the device; {why})"
    need = offloaded * per_node
    return (head + f"{fmt(offloaded)} per rank of activations offloaded by the ILP plan, {fmt(need)} per node at "
            f"{per_node} ranks per node (assumed: min(ranks, {RANKS_PER_NODE}))"
            + (f"; the transfers to host and back take {seconds * 1e3:.3g} ms per step (cost model's host link, "
               "on a side stream, overlapped with compute)" if seconds else "")
            + ("" if need <= host else f": {fmt(need - host)} more than the node has. Fix: --host-memory with the "
               "node's size, or leave --offload out"))


@dataclass
class Report:
    """`autosp plan`'s answer: its text, whether anything fits, and the step that trains the ILP row's length."""
    text: str
    ok: bool
    step: Step | None = None        # the planned step at the longest length the ILP plan fits (None: none fits)

    @property
    def length(self) -> int:
        return self.step.seq_len if self.step is not None else 0

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Answer:
    """`autosp plan`'s answer to one command line: the text it prints, whether its step fits, and the plan cache's
    file it was read from (None: planned here)."""
    text: str
    ok: bool
    stored: str | None = None


def answer(step: Step, granularity: int | None = None) -> Answer:
    """`autosp plan`'s answer: at_length's with --seq-len, else longest's; read back from the plan cache
    (remat/store.py) where the same question was answered before, with nothing traced or differentiated, and kept
    there when every MIP of its making finished. The text is the one first printed, "Planned in" included."""
    from autosp.remat import store
    from autosp.remat.solve import time_limits
    name = store.answer_key(*_question(step, granularity))
    kept = store.load(name)
    if kept is not None and kept[0] == "answer":
        return Answer(kept[1], kept[2], str(store.path(name)))
    limited = time_limits()
    if step.seq_len is not None:
        fit = at_length(step)
        said = Answer(fit.text(), fit.fits)
    else:
        report = longest(step, granularity=granularity)
        said = Answer(report.text, report.ok)
    if time_limits() == limited:
        store.save(name, ("answer", said.text, said.ok))
    return said


def _question(step: Step, granularity: int | None) -> tuple[str, ...]:
    """What `autosp plan`'s answer for `step` is a function of, besides autosp's sources and the versions the plan
    cache keys every entry by: the question as normalised (the Step, the granularity the answer is given in), the
    model config's bytes (a preset's shapes are in autosp's sources) and transformers' version (it builds and
    traces the model), the device's cost and memory model, the threads the plan is priced at (CPU attention's
    scratch is per thread: _as_ranks_run) and the AUTOSP_ environment (AUTOSP_OVERLAP, AUTOSP_MASK_FUNCTIONS, ...;
    not the cache's own folder)."""
    import importlib.metadata
    import os

    from autosp.remat.cost import device_for
    from autosp.run.launch import rank_threads
    from autosp.run.models import PRESETS, _config_file
    if step.model in PRESETS:
        model = repr(PRESETS[step.model])
    else:
        with open(_config_file(step.model), "rb") as f:
            model = f.read().hex()
    granule = None if step.seq_len is not None else (granularity or step.sp * 64)
    threads = (rank_threads(step.world) if step.device == "cpu" else None, torch.get_num_threads())
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("AUTOSP_") and k != "AUTOSP_PLAN_CACHE")
    return (repr(step), f"granularity {granule}", model, importlib.metadata.version("transformers"),
            repr(device_for(step.target, step.host_bandwidth)), f"threads {threads}", repr(env))


@contextlib.contextmanager
def full_collections_rarely():
    """Python's full collections a tenth as often as by default, within: planning makes graphs of 10^5-10^6
    objects and each full collection scans every one (10 % of `autosp plan --model tiny`'s time); the young
    generations, which free the cycles a pass makes and drops, run as often as before."""
    import gc
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], max(thresholds[2], 100))
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


@contextlib.contextmanager
def _as_ranks_run(step: Step):
    """Plan a CPU step at the thread count its ranks run with (launch.rank_threads: the cores shared out), not this
    process's: ATen's CPU attention holds scratch per thread (1 MiB a thread for a 256 x 512 block in fp32), and a
    verdict priced at 2 threads refused lengths that ranks of 1 thread each fit."""
    if step.device != "cpu":
        yield
        return
    from autosp.run.launch import rank_threads
    before = torch.get_num_threads()
    torch.set_num_threads(rank_threads(step.world))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cost_model(name: str) -> str:
    """The banner's words for the device a plan is priced for."""
    from autosp.remat.cost import device_for
    d = device_for(name)
    return name if d.kind == "cpu" else (f"{name}: {d.title}" + (f", attention by SDPA's {d.attention} backend"
                                                                  if "SDPA" not in d.title else "")
                                         + ("; --gpu names another" if name == "cuda" else ""))


def _tracer(step: Step, spec) -> Tracer:
    tracer = Tracer(spec, planning_mesh(step.sp, step.dp), step.dtype, step.rank_batch, step.sp,
                    shard_params=step.sharded, ring=step.ring, reduce_dtype=step.grad_dtype, packing=step.packing,
                    objective=step.objective, beta=step.beta, lora=step.lora)
    tracer.key = step.with_length(None)     # the traces are a function of the step's flags and the length
    return tracer


def _state_fails(step: Step, st: ModelState, share: int) -> str | None:
    """Why the model state alone does not fit the device or the host ('-> ...' with the fix), or None."""
    mem = step.memory_bytes
    if mem is not None and st.total >= mem:
        if step.sharded:
            fix = "more ranks to shard it over (--dp)"
        elif step.world > 1:
            per = st.params // step.dtype.itemsize * (8 + 4 * _MOMENTS[step.optimizer]) / step.world
            fix = f"leave out --no-shard-params (sharded over the {step.world} ranks: about {fmt(per)} per rank)"
        else:
            fix = "more ranks (--sp, --dp), over which the model state is sharded"
        return (f"-> the model state alone needs {fmt(st.total)}, {fmt(st.total - mem)} more than the "
                f"{fmt(mem)} per rank: no sequence length fits in any configuration. Fix: {fix}, more memory "
                "per rank" + (", --optimizer-offload" if not step.optimizer_offload else "")
                + (", --optimizer sgd" if step.optimizer != "sgd" else "") + ", or a smaller model.")
    if st.host > share:
        return (f"-> with --optimizer-offload the model state needs {fmt(st.host)} of host memory per rank, "
                f"more than this rank's share of the node, {fmt(share)}. Fix: --host-memory with the node's "
                "size, more ranks, or leave --optimizer-offload out.")
    return None


def longest(step: Step, *, parallel: bool = True, granularity: int | None = None, check: bool = True) -> Report:
    """The report of `autosp plan` without --seq-len: the longest length each configuration trains within
    step.memory (see plan.py's docstring for the method). `parallel`: probe the two lengths in two processes
    (a fork; pass False in a process whose threads make forking unsafe). `check`: hold the ILP row's length to
    train's own verdict (_checked); False answers the row's length as it is."""
    t_start = time.perf_counter()
    if step.memory is None:
        raise AutospError("autosp plan: no --memory and no --seq-len: nothing to answer. Fix: --memory 80GiB (the "
                          "longest length that fits it), or --seq-len 32768 (the memory that length needs).")
    mem = step.memory_bytes
    host, sp, dp, batch, device, offload = (step.host_node_bytes, step.sp, step.dp, step.rank_batch, step.target,
                                            step.offload)
    dtype, optimizer, world, sharded = PRECISIONS[step.precision], step.optimizer, step.world, step.sharded
    host_memory, model = step.host_memory, step.model
    granule = granularity or sp * 64
    if granule % sp:
        raise AutospError(f"--granularity {granule}: lengths must split over sp={sp} ranks. Fix: a multiple of {sp}.")
    spec = spec_of(step)
    torch_dtype = step.dtype
    share = step.host_share
    planning = contextlib.ExitStack()              # closed early where verdicts alone answer (_by_verdicts)
    with planning:
        planning.enter_context(fake_world(world))
        planning.enter_context(_as_ranks_run(step))
        tracer = _tracer(step, spec)
        n = tracer.n_params
        st = model_state(step, tracer.param_bytes, tracer.trainable_bytes)
        host_rank = step.activation_host_bytes(st.host) if offload else None     # what the activations may take
        out = [f"autosp plan: {describe(spec)}\n  {n / 1e9:.3f}B parameters in {dtype}; mesh dp {dp} x sp {sp}"
               + (f" (ring {step.ring})" if step.ring else "") + f"; {fmt(mem)} per rank; cost model {_cost_model(device)}; "
               f"{batch} sequence(s) per dp rank" + (f" (DPO: {batch} pair(s), {2 * batch} sequences per step, the reference "
                                                 "pass planned by autosp plan --seq-len)" if step.objective == "dpo" else ""),
               _state_line(st, tracer, optimizer, dtype, dp, sp)]
        host_line = _host_line(host, host_memory is not None, world, offload, None, state=st.host)
        refused = _state_fails(step, st, share)
        if refused:
            out += [refused, host_line]
            return Report("\n".join(out), False)
        fixed = st.params + st.moments                     # live across the step; the step's peak adds the rest
        fixed += st.grads if step.grad_accum > 1 else 0    # the gradients summed over the micro-steps
        avail = mem - fixed

        def tokens(length):                                 # the token ids (and labels, positions)
            return step.with_length(length).token_bytes()

        # no remat keeps every gathered parameter for the backward: the guess leaves room for them
        kept = tracer.compute_bytes if sharded else 0
        l1 = max(32 * granule, _rounded(_guess(spec.config, avail - st.grads - kept, torch_dtype, sp, batch), granule))
        l2 = 4 * l1

        def plan_length(priced) -> int:
            """The longest length a plan priced at l1 and l2 fits: the device's bytes, and the host's."""
            a, b = priced[l1], priced[l2]
            length = Affine.fit(l1, a.values + tokens(l1), l2, b.values + tokens(l2)).longest(avail, granule)
            if host_rank is not None and b.host > a.host:   # the offloaded bytes grow too: the host caps the length
                length = min(length, _line(a.host, l1, b.host, l2).longest(host_rank, granule))
            return length

        try:
            q = probe(tracer, l1, l2, device, offload, parallel, host_rank, plan_length, step.tile,
                      step.host_bandwidth)
        except NotAffine as exc:                        # a loop along the sequence: verdicts alone answer
            planning.close()
            return _by_verdicts(step, granule, l1, out, str(exc), parallel, t_start)

        def row(name, p1, p2, length, note=""):
            """The row of a program priced at both lengths, at `length` (none: 0)."""
            if not length:
                return Row(name, length, None, None, note)
            peak, saved = p1.at(p2, l1, l2, length, tokens)
            return Row(name, length, peak, tuple(int(_line(a, l1, b, l2).peak(length)) for a, b in zip(p1.comm, p2.comm)),
                       note, step_seconds(p1.terms, l1, p2.terms, l2, length, device), saved,
                       int(_line(p1.host, l1, p2.host, l2).peak(length)))

        rows = []
        for key, name in (("nosp", "no SP"), ("sp", f"SP={sp}, no remat")):
            p1, p2 = q.profiles[(key, l1)], q.profiles[(key, l2)]
            if p1.shape != p2.shape or len(p1.values) != len(p2.values):
                raise NotAffine(f"autosp plan: {model}'s program differs between lengths {l1} and {l2}, so its "
                                  "memory cannot be solved for in closed form. Fix: plan with autosp.plan at the "
                                  "lengths you need (the Python API).")
            length = Affine.fit(l1, p1.values + tokens(l1), l2, p2.values + tokens(l2)).longest(avail, granule)
            rows.append(row(name, p1, p2, length))

        # SP with the ILP plan: the plan with the least peak found at l2, priced at both lengths, so its
        # longest length is solved for exactly
        floor_len = rows[1].length
        pa, pb = q.plan[l1], q.plan[l2]
        ha, hb = pa.host, pb.host
        aff = Affine.fit(l1, pa.values + tokens(l1), l2, pb.values + tokens(l2))
        length = plan_length(q.plan)
        name = f"SP={sp}, ILP plan (save/recompute{'/offload' if offload else ''})"
        if length <= floor_len:
            rows.append(Row(name, floor_len, rows[1].peak, rows[1].comm, "no plan found fits a longer length than "
                                                                        "saving everything", rows[1].seconds,
                            rows[1].saved))
        else:
            host_bytes = int(_line(ha, l1, hb, l2).peak(length))
            rows.append(row(name, pa, pb, length,
                            f"the plan with the least peak found at {l2:,} ({fmt(q.least)}"
                            + f", by {q.method if q.method != 'ILP' else 'the ILP'}"
                            + f"), replayed at {l1:,}, "
                            f"fits up to {length:,}"
                            + (f"; it tiles {', '.join(_tiled_names(q.tiling))}" if q.tiling else "")
                            + (f"; it offloads {fmt(host_bytes)} to host memory per rank" if host_bytes else "")
                            + "; " + _held_back(aff, length, granule, avail, host_bytes, host_rank, ha, hb, l1, l2)))
            host_line = _host_line(host, host_memory is not None, world, offload, host_bytes,
                                   q.offload_seconds * host_bytes / hb if hb else None, st.host)
    # one answer: the ILP row shows the length the printed `autosp train` command trains, and that plan's memory
    note = "not checked against train's plan"
    if rows[2].length and check:
        length, note, fit = _checked(step.with_length(rows[2].length), granule, parallel)
        if length != rows[2].length:                   # the row: train's verdict at that length, its least-peak plan
            if fit is None or fit.least_plan is None or (fit.least_plan[1] is None and fit.least_split is None):
                fit = at_length(step.with_length(length), with_longest=False, quick=True)
            if fit.least_plan[1] is None and fit.least_split is None:   # read from the plan cache: plan it here
                fit = _plan_least(step.with_length(length))
            plan = fit.least_plan[0]
            seconds, comm, saved = fit.least_split or _split(fit)
            rows[2] = Row(rows[2].name, length, plan.peak_bytes + fit.tokens, comm,
                          f"the plan autosp train's verdict finds within the budget at {length:,} "
                          f"({fmt(plan.peak_bytes)}"
                          + (f", by {plan.method}" if plan.method != "ILP" else "")
                          + (f"; it tiles {', '.join(_tiled_names(plan.tiling))}" if plan.tiling else "")
                          + ("; attention backward by autosp's kernel" if plan.attention_backward != "sdpa" else "")
                          + f"; the one found at {l2:,} and replayed at {l1:,} fit up to {rows[2].length:,})",
                          seconds, saved, plan.offload_bytes)
            host_line = _host_line(host, host_memory is not None, world, offload, plan.offload_bytes,
                                   plan.offload_seconds, st.host)
    # replicated: the gradients are all-reduced after the step, by ring; sharded: reduce-scattered in it
    dp_comm = 0 if sharded else ring_allreduce_bytes(st.grads, dp)
    sp_grad = 0 if sharded else ring_allreduce_bytes(st.grads, sp)

    out.append(f"longest trainable sequence (tokens per sequence, a multiple of {granule}) and per-rank memory:\n")
    out.append("| configuration | longest sequence | memory per rank | model state | the step's peak: saved for "
               "the backward | + its working set | offloaded to host per rank | collectives sent per rank per step |")
    out.append("|---|---|---|---|---|---|---|---|")
    for r in rows:
        seq, par = r.comm or (0, 0)
        grads = par + dp_comm + (sp_grad if r.name != "no SP" else 0)
        what = "parameter gathers and gradient reduce-scatters" if sharded else "gradients"
        if r.length:
            out.append(f"| {r.name} | {r.length:,} | {fmt(fixed + r.peak)} | {fmt(fixed)} | {fmt(r.saved)} | "
                       f"{fmt(r.peak - r.saved)} | {fmt(r.host) if r.host else '-'} | "
                       f"{fmt(seq + grads)} ({fmt(seq)} sequence, {fmt(grads)} {what}) |")
        else:
            out.append(f"| {r.name} | none ({granule} tokens do not fit) | - | - | - | - | - | - |")
    if rows[1].length and rows[2].length:
        out.append(f"\nILP plan / SP without remat: {rows[2].length / rows[1].length:.2f}x the length"
                   + (f"; SP without remat / no SP: {rows[1].length / rows[0].length:.2f}x" if rows[0].length else ""))
    timed = [f"{r.name} {_secs(r.seconds)} ({r.length / r.seconds:,.0f} tokens/s)" for r in rows if r.seconds]
    if timed:
        from autosp.remat.cost import device_for
        d = device_for(device, step.host_bandwidth)
        out.append("step time per rank at that length, the cost model's estimate "
                   f"({device}: {d.flops / 1e12:g} TFLOP/s, {d.mem_bw / 1e12:g} TB/s memory, {d.link_bw / 1e9:g} GB/s links; every equation of the step, "
                   "recomputations included, one after another; host transfers overlap it): " + "; ".join(timed))
    heads = getattr(spec.config, "num_attention_heads", None)
    if heads and sp > 1:
        from autosp.passes.shard_rules import factorise
        u, r = factorise(sp, heads)
        out.append(f"attention at sp={sp}: " + (f"Ulysses all-to-all over the {sp} ranks ({heads // sp} of {heads} heads each)"
                   if r == 1 else f"{heads} heads run out: all-to-all over {u} ranks x ring attention over {r} "
                   f"(zigzag order; per layer each rank passes {r - 1} K/V block{'s' if r > 2 else ''} around its ring)"))
    out.append(host_line)
    out.append(f"\nhow: two meta traces (lengths {l1:,} and {l2:,}) fix each program's bytes at every point of the "
               "step as an affine function of the length (a program's values are either independent of the length "
               "or proportional to it), solved for exactly: the no-remat programs, and the ILP plan; " + rows[2].note + ".")
    if sharded:
        out.append(f"memory per rank = model state (fp32 master shard + optimizer state, {fmt(fixed)}) + the "
                   "step's peak, split at the point of the peak into what the forward saved for the backward "
                   f"(activations, and the gathered {dtype} parameters it keeps) and the working set (the values in "
                   f"flight, temporaries, collective buffers, the gathered {dtype} parameters in use, the fp32 "
                   f"gradient shards, the token ids). Parameters are gathered and gradients reduce-scattered over "
                   f"the {world} ranks inside the step (no separate all-reduce). Without remat every gathered "
                   f"parameter is kept for the backward ({fmt(tracer.compute_bytes)} for the whole model), as "
                   "autograd keeps them; the ILP plan may gather again instead. The no-SP row runs every sequence "
                   f"whole on each rank with the same sharded model state (dp {world} x sp 1: FSDP2 without SP)."
                   f" Planned in {time.perf_counter() - t_start:.0f} s.")
    else:
        out.append(f"memory per rank = model state (parameters + optimizer state, {fmt(fixed)}) + the step's "
                   "peak, split at the point of the peak into what the forward saved for the backward (activations) "
                   "and the working set (the values in flight, temporaries, collective buffers, gradients, the token "
                   "ids). Gradients are all-reduced over sp"
                   + (" and dp" if dp > 1 else "") + f" by ring ({fmt(sp_grad + dp_comm)} sent per rank)."
                   f" Planned in {time.perf_counter() - t_start:.0f} s.")
    best = step.with_length(rows[2].length) if rows[2].length else None
    if best is not None:
        out.append(f"\n{note}\ntrain it (it plans the step again before its first one, within --memory):\n"
                   f"  {best.train_command()}")
    return Report("\n".join(out), best is not None, best)


def _by_verdicts(step: Step, granule: int, start: int, head: list[str], why: str, parallel: bool,
                 t_start: float) -> Report:
    """`autosp plan`'s answer for a step whose program grows with the length (a recurrence's torch reference path:
    one pass per chunk), which two traces cannot solve for: the longest length train's own verdict fits, found by
    asking it (_checked, from the dense guess `start`), each verdict a trace and a least-peak search at its length.
    No table of configurations: each would be a search of its own."""
    length, note, fit = _checked(step.with_length(start), granule, parallel, origin="a dense model's guess,")
    lines = head + [why.replace("autosp plan: ", "").split(" Fix:")[0].rstrip(".") + ".",
                    "so the answer is train's own verdict at each length asked (a trace and a least-peak search "
                    "each), with no table of configurations."]
    if note.startswith("checked: train's own plan fits no"):
        lines.append(f"{note}. Fix: more --memory, more ranks (--sp), or --memory-budget / --offload.")
        return Report("\n".join(lines), False)
    best = step.with_length(length)
    if fit is None or fit.least is None:
        fit = at_length(best, with_longest=False, quick=True)
    lines += [f"longest trainable sequence (tokens per sequence, a multiple of {granule}): {length:,} tokens fit in "
              f"{fmt(step.memory_bytes)} per rank: train's planner reaches a peak of {fmt(fit.least)} there, within "
              f"the {fmt(fit.budget)} --memory leaves the step (model state {fmt(fit.state.resident)}, token ids "
              f"{fmt(fit.tokens)}). Planned in {time.perf_counter() - t_start:.0f} s.",
              f"\n{note}\ntrain it (it plans the step again before its first one, within --memory):\n"
              f"  {best.train_command()}"]
    return Report("\n".join(lines), True, best)


def _checked(step: Step, granule: int, parallel: bool = True, origin: str = "the ILP row's"):
    """The ILP row's length held to the plan `autosp train` makes (at_length's verdict): the longest multiple of
    `granule` near it that train's plan fits, one granule more refused. The row's plan is the least-peak plan found
    at the longer probe; train plans the least at its own length, trying every tiling, which may reach a little
    further (or, rarely, not as far). Each verdict is a plan (a trace and the least-peak search at that length), so
    they are asked two at a time (L and L + granule, side by side) and the next pair is aimed, not walked to: each
    verdict says by how many bytes its least peak is over or under the budget, and that excess grows with the
    length as a step's bytes do, so the pair goes where the line through the nearest verdicts crosses zero (within
    the lengths known to fit and not to fit; by halving where the line does not help). (length, the line that
    says so, the verdict's Fit where this process made it, else None)"""
    from autosp.remat.helper import idle_core
    from autosp.run.plan import _both
    first = step.seq_len
    excess: dict[int, float] = {}                   # length -> least peak - budget (fits: <= 0)
    host: dict[int, float] = {}                     # length -> what the least-peak plan offloads - the host cap
    here: dict[int, Fit] = {}                       # the verdicts this process made (the others' are in children)

    def verdict(length: int, away: bool = False) -> tuple[float, float | None, Fit | None]:
        """(excess, host excess, the Fit where it was made `away`, in the other process: the answer may be its
        length, and the table's row is its least-peak plan, so a fit comes back with that plan's split rather than
        being planned a second time here, 8 s at 8B)."""
        fit = here[length] = at_length(step.with_length(length), with_longest=False, quick=True)
        if getattr(fit, "verdict", None) is None or fit.least is None:   # no verdict by --memory: fits or not
            return (-1.0 if fit.fits else 1.0), None, None
        least = (getattr(fit, "least_plan", None) or (None,))[0]
        offloaded = getattr(least, "offload_bytes", 0)
        e = float(fit.least - fit.budget)
        back = None
        if away and e <= 0 and isinstance(fit, Fit) and fit.least_plan[1] is not None:
            _split(fit)
            back = replace(fit, least_plan=(least, None))
        return e, (float(offloaded - fit.host_cap) if offloaded else None), back

    def ask(*lengths: int) -> None:
        new = [x for x in lengths if x >= granule and x not in excess]
        if len(new) == 2:
            out = _both(lambda: verdict(new[0]), lambda: verdict(new[1], away=parallel), parallel)
        else:                                       # alone: its search's next end on the other core (helper.py)
            with idle_core() if parallel else contextlib.nullcontext():
                out = [verdict(x) for x in new]
        for x, (e, h, fit) in zip(new, out):
            excess[x] = e
            if h is not None:
                host[x] = h
            if fit is not None:
                here[x] = fit

    def host_edge(lo: int | None, hi: int | None) -> int | None:
        """Where the host fills: the longest length at which the line through a pair of fitting verdicts a granule
        apart (the longest such pair whose offloaded bytes grow: one plan, its kept values offloaded in the same
        places) is within the host cap, when that is no shorter than `lo`, within `hi`, not asked yet, and the
        device's own line through the pair crosses zero no earlier. There the least-peak plan's excess may jump
        (one more kept value no longer fits the host and is saved on the device: +3.4 GiB at 8B on 32 ranks,
        9 MiB a granule below it), which no line through the device's excess finds; aimed at, the pair there
        settles it. Where the host fills earlier and nothing jumps, it is one more pair of fits to go on from."""
        pairs = [x for x in host if x + granule in host and excess[x] <= 0 and excess[x + granule] <= 0
                 and host[x + granule] > host[x]]
        if not pairs:
            return None
        x1 = max(pairs)
        x2 = x1 + granule
        h1, h2, e1, e2 = host[x1], host[x2], excess[x1], excess[x2]
        x = int((x1 - h1 * (x2 - x1) / (h2 - h1)) // granule * granule)
        if e2 > e1 and x1 - e1 * (x2 - x1) / (e2 - e1) < x:
            return None                                  # the device fills first
        if x < (lo or 0) or (hi is not None and x + granule > hi) or (x in excess and x + granule in excess):
            return None
        return x

    def bracket() -> tuple[int | None, int | None]:
        lo = max((x for x, e in excess.items() if e <= 0), default=None)
        hi = min((x for x, e in excess.items() if e > 0 and (lo is None or x > lo)), default=None)
        return lo, hi

    def aim(lo: int | None, hi: int | None) -> tuple[int, bool]:
        """The next length to ask, and whether it was aimed (then it is asked with the length a granule on): where
        the line through two verdicts meets zero (the lengths that bracket the answer, else the two farthest apart:
        the longest baseline averages out the least-peak search's own steps); else by halving or doubling."""
        xs = sorted(excess)
        x1, x2 = (lo, hi) if lo is not None and hi is not None else (xs[0], xs[-1])
        e1, e2 = excess[x1], excess[x2]
        guess = x1 - e1 * (x2 - x1) / (e2 - e1) if e2 > e1 and abs(e1) != 1.0 else None
        if lo is not None and hi is not None:
            mid = lo + (hi - lo) // granule // 2 * granule
            if guess is None or (stalled and hi - lo > 4 * granule):
                return mid, False
            x = int(guess) // granule * granule
            return min(max(x, lo + granule), hi - granule), lo + granule < x < hi - granule
        if guess is not None:                            # a pair where the line says; one length where it is clamped
            x = int(guess) // granule * granule
            if hi is None:                               # everything asked fits: beyond the longest
                return max(x, xs[-1] + granule), x > xs[-1] + granule
            return max(granule, min(x, xs[0] - granule)), granule < x < xs[0] - granule
        spread = max(xs[-1] - xs[0], granule)            # doubling the distance from the first length asked
        return (xs[-1] + spread if hi is None else max(granule, xs[0] - spread)), False

    ask(first, first + granule)
    stalled, width, edges = False, None, 0
    while True:
        lo, hi = bracket()
        if lo is not None and hi is not None and hi - lo <= granule:
            break
        if lo is None and min(excess) <= granule:
            return first, f"checked: train's own plan fits no multiple of {granule} tokens up to {first:,}", None
        if lo is not None and hi is not None:            # a bracket that did not halve: halve it next
            stalled = width is not None and (hi - lo) > width // 2
            width = hi - lo
        edge = host_edge(lo, hi) if edges < 2 else None     # twice at most: a line that misses is not walked on
        edges += edge is not None
        x, aimed = (edge, True) if edge is not None else aim(lo, hi)
        ask(x, x + granule) if aimed else ask(x)
    length = lo
    how = (f"{origin} length" if length == first else
           f"{(length - first) // granule:+d} granule(s) from {origin} {first:,}")
    return length, (f"checked against the plan autosp train makes (autosp plan --seq-len): {length:,} tokens fit "
                    f"({how}), {length + granule:,} do not ({len(excess)} verdicts)"), here.get(length)


# ---------------------------------------------------------------- one length: what `autosp train` runs

@dataclass
class Fit:
    """The step at one length, planned as `autosp train` plans it before its first step (the same budget,
    host capacity, tiling and ring, so the same plan): `autosp plan --seq-len L`'s answer and train's check."""
    step: Step
    state: ModelState
    tokens: int                     # the token ids a rank holds through its step
    budget: object = None           # the step's remat budget (value_and_grad's memory_budget)
    host_cap: int = 0               # bytes per rank the plan may offload to host memory
    plan: object = None             # the remat Plan; None: refused
    saved: int = 0                  # of the step's peak, the bytes the forward saved for the backward
    seconds: float = 0.0            # the cost model's step time per rank
    comm: tuple[int, int] = (0, 0)  # bytes sent per rank: (sequence collectives, parameter collectives)
    least: int | None = None        # refused by the planner: the least step peak it reaches
    why: str = ""                   # refused: why
    report: Report | None = None    # refused: `autosp plan` for the same flags (the longest that fits)
    verdict: bool | None = None     # the budget is what --memory leaves: whether the least peak fits it (fits)
    least_plan: tuple | None = None  # that verdict's (Plan, Program); the Program None when read from the plan cache
    least_split: tuple | None = None  # that Program's (seconds, comm, saved at its peak), where worked out (_split)
    reference: int = 0              # DPO: the reference pass's peak (forward only, before the first step; dpo.py)

    @property
    def resident(self) -> int:
        """Bytes kept across the step: the model state (parameters, optimizer moments, with --grad-accum the
        gradients summed so far) and the token ids."""
        return self.state.resident + self.tokens + (self.state.grads if self.step.grad_accum > 1 else 0)

    @property
    def peak(self) -> int | None:
        """The predicted per-rank peak of allocated device bytes over a training step, model state included."""
        return None if self.plan is None else (self.resident + self.plan.const_bytes
                                               + max(self.plan.peak_bytes, self.reference))

    @property
    def fits(self) -> bool:
        """Within --memory: the least peak the planner reaches at this length (the verdict, when the budget is what
        --memory leaves) is within the budget; else a plan was made and its peak is within --memory."""
        mem = self.step.memory_bytes
        if self.verdict is not None:
            return self.verdict
        return self.plan is not None and (mem is None or self.peak <= mem)

    @property
    def needed(self) -> int | None:
        """The memory per rank this length needs at the least (refused: with the least peak found)."""
        if self.plan is not None:
            return self.peak
        return None if self.least is None else self.resident + self.least

    def text(self) -> str:
        s, L = self.step, self.step.seq_len
        mem = s.memory_bytes
        lines = [f"autosp plan: {s.model} at {L:,} tokens, dp {s.dp} x sp {s.sp}"
                 + (f" (ring {s.ring})" if s.ring else "") + f", {s.global_batch} {'pair(s)' if s.objective == 'dpo' else 'sequence(s)'} per step, "
                 f"{s.precision}, cost model {_cost_model(s.target)}" + (f"; {fmt(mem)} per rank" if mem is not None else "")]
        if self.fits:
            p = self.plan
            lines.append(f"-> {L:,} tokens {'fit in ' + fmt(mem) + ' per rank' if mem is not None else 'need'}: "
                         f"predicted peak {fmt(self.peak)} per rank of allocated device memory = model state "
                         f"{fmt(self.state.resident)} (parameters {fmt(self.state.params)}, optimizer "
                         f"{fmt(self.state.moments)}) + token ids {fmt(self.tokens)}"
                         + (f" + the program's constants {fmt(p.const_bytes)}" if p.const_bytes else "")
                         + " + the step's peak "
                         f"{fmt(p.peak_bytes)} (saved for the backward {fmt(self.saved)}, working set "
                         f"{fmt(p.peak_bytes - self.saved)})")
            host = self.state.host + p.offload_bytes
            lines.append(f"   host memory per rank: {fmt(host)}" + (
                f" ({fmt(p.offload_bytes)} of activations offloaded, within this rank's {fmt(self.host_cap)}"
                + (f"; {fmt(self.state.host)} of optimizer state" if self.state.host else "") + ")"
                if host else " (nothing offloaded)"))
            how = (f"budget {fmt(p.budget_bytes)}" if p.budget_bytes is not None else "no budget") + (
                ", no remat needed" if p.peak_bytes >= p.no_remat_peak_bytes else
                f", {sum(d.action == 'recompute' for d in p.decisions)} values recomputed"
                + (f", {sum(d.action == 'offload' for d in p.decisions)} offloaded" if p.offload_bytes else "")
                + (f" (found by {p.method})" if p.method != "ILP" else ""))
            if p.tiling:
                how += "; tiles " + ", ".join(_tiled_names(p.tiling))
            lines.append(f"   the step's plan: {how}; no-remat peak {fmt(p.no_remat_peak_bytes)}")
            if s.objective == "dpo":
                lines.append(f"   DPO: {s.rank_batch} pair(s) per rank and micro-step = {2 * s.rank_batch} sequences; the "
                             f"reference pass (forward only, before the first step) peaks at {fmt(self.reference)}, "
                             f"{'within' if self.reference <= p.peak_bytes else 'above'} the step's")
            lines.append(f"   step time per rank, the cost model's estimate: {_secs(self.seconds)} "
                         f"({s.rank_batch * (2 if s.objective == 'dpo' else 1) * L / self.seconds:,.0f} tokens/s); collectives sent per rank: "
                         f"{fmt(sum(self.comm))}")
            lines.append(f"train it:\n  {s.train_command()}")
            return "\n".join(lines)
        lines.append(self.refusal())
        return "\n".join(lines)

    def refusal(self) -> str:
        """Why this length does not fit, the longest that does, and what would make it fit."""
        s, L, mem = self.step, self.step.seq_len, self.step.memory_bytes
        if self.plan is None and self.least is None:
            return self.why
        need = self.needed
        head = (f"{L:,} tokens do not fit in {fmt(mem)} per rank: " if mem is not None else
                f"{L:,} tokens cannot be planned under --memory-budget {s.memory_budget}: ")
        if self.plan is not None:
            head += (f"the plan under --memory-budget {s.memory_budget} peaks at {fmt(need)} per rank (model state and "
                     f"token ids {fmt(self.resident)} + the step's {fmt(self.plan.peak_bytes)})")
        else:
            head += (f"the least peak autosp reaches at that length is {fmt(need)} per rank (model state and token "
                     f"ids {fmt(self.resident)} + the step's least {fmt(self.least)})")
        fixes = []
        if self.report is not None and self.report.length:
            fixes.append(f"--seq-len {self.report.length} (the longest length these flags fit: "
                         f"{self.report.step.train_command()})")
        elif self.report is not None:
            fixes.append("no length fits these flags (autosp plan says why)")
        if mem is not None and need is not None:
            fixes.append(f"--memory {_up(need)} or more")
        fixes.append(f"more sequence-parallel ranks (--sp {2 * s.sp})")
        if not s.offload:
            fixes.append("--offload (activations to host memory)")
        if not s.optimizer_offload and s.optimizer == "adamw":
            fixes.append("--optimizer-offload")
        return head + ". Fix: " + ", ".join(fixes) + "."


def _up(n: int) -> str:
    """A size at least n, written as a flag takes it (MiB or GiB, rounded up)."""
    import math
    if n >= 2**30:
        return f"{math.ceil(n / 2**30 * 100) / 100:g}GiB"
    return f"{math.ceil(n / 2**20 * 100) / 100:g}MiB"


def at_length(step: Step, *, with_longest: bool = True, parallel: bool = True, quick: bool = False) -> Fit:
    """The step at step.seq_len, planned as train plans it (see Fit). Refused with --memory and `with_longest`:
    the report of `longest` for the same flags is attached (the longest length that fits).

    When the budget is what --memory leaves the step, whether it fits is one verdict, the same for `autosp plan
    --seq-len`, train's check before its first step and `autosp plan`'s check of its own answer: the least peak
    the planner reaches at this length (its least-peak search, as `autosp plan` runs it, on the step tiled as far
    as it goes and untiled: the lower) within that budget. Train's planner then finds a plan within it (the
    same search at the same tilings, finer). `quick`: the verdict alone, without the plan train runs; its least
    peak is then that of the first plan found within the budget (the most tiled step with the backend's attention
    backward first, per-layer checkpointing before the MIPs), the rest searched only where none is: the same
    verdict (the least is at most that plan's peak), the fits' excess not the least's."""
    from autosp.remat import plan_step
    if step.seq_len is None:
        raise AutospError("autosp plan: at_length needs --seq-len. Fix: pass --seq-len, or plan the longest length.")
    spec = spec_of(step)
    with fake_world(step.world), _as_ranks_run(step):
        tracer = _tracer(step, spec)
        st = model_state(step, tracer.param_bytes, tracer.trainable_bytes)
        fit = Fit(step, st, step.token_bytes())
        refused = _state_fails(step, st, step.host_share)
        if refused:
            fit.why, fit.verdict = refused, False
            return fit
        fit.budget = step.step_budget(fit.resident)
        fit.host_cap = step.activation_host_bytes(st.host)
        local = tracer.local(step.seq_len)
        if step.objective == "dpo":                 # the run's peak is the larger of the step's and this one's
            from autosp.run.dpo import reference_peak
            fit.reference = reference_peak(tracer, step.seq_len, step.target)
        args = dict(device=step.target, host_bandwidth=step.host_bandwidth, host_memory=fit.host_cap)
        tiles = None if step.tile else {}
        if step.memory_budget is None and step.memory is not None:         # the budget is what --memory leaves
            least, program, _, _ = plan_step(local, "least", refine=False, tiles=tiles, plan_only=quick,
                                             enough=fit.budget if quick else None, **args)
            fit.least = least.peak_bytes + least.const_bytes      # the constants are held through the step too
            fit.least_plan = (least, program)
            fit.verdict = max(fit.least, fit.reference) <= fit.budget
            if not fit.verdict:
                fit.why = (f"the least peak autosp reaches is {fmt(fit.least)}, {fmt(fit.least - fit.budget)} over "
                           f"the {fmt(fit.budget)} --memory leaves the step")
        if quick:
            return fit
        if fit.verdict is not False:
            _plan_it(fit, local, tiles, args)
    if not fit.fits and with_longest and step.memory is not None and not fit.why.startswith("->"):
        fit.report = longest(step.with_length(None), parallel=parallel)
    return fit


def _plan_least(step: Step) -> Fit:
    """at_length's verdict planned afresh (the plan cache off): its least-peak plan with its programs."""
    import os
    before = os.environ.get("AUTOSP_PLAN_CACHE")
    os.environ["AUTOSP_PLAN_CACHE"] = "off"
    try:
        return at_length(step, with_longest=False, quick=True)
    finally:
        if before is None:
            os.environ.pop("AUTOSP_PLAN_CACHE")
        else:
            os.environ["AUTOSP_PLAN_CACHE"] = before


def _split(fit: Fit) -> tuple:
    """fit.least_split: its least-peak program's step time (the cost model's), collective bytes and the bytes saved
    for the backward at its peak, in the planning world (the collectives' groups, as the probes had them)."""
    from autosp.remat.cost import device_for, eqn_cost
    from autosp.run.plan import _profile, comm_bytes
    step, program = fit.step, fit.least_plan[1]
    with fake_world(step.world), _as_ranks_run(step):
        values, saved, _ = _profile(program, step.target)
        comm = comm_bytes(program)
    dev = device_for(step.target, step.host_bandwidth)
    seconds = sum(eqn_cost(e, dev).seconds for g in (program.forward, program.backward) for e in g.eqns)
    fit.least_split = (seconds, comm, int(saved[int(np.argmax(values))]))
    return fit.least_split


def _plan_it(fit: Fit, local, tiles, args) -> None:
    """Fill in the plan train's ranks will make for `local` under fit.budget, with its split, time and traffic."""
    from autosp.remat import BudgetError, plan_step
    from autosp.remat.cost import device_for, eqn_cost
    from autosp.run.plan import _profile, comm_bytes
    step = fit.step
    budget = 1.0 if fit.budget is None else fit.budget        # no budget: what autograd saves, planned
    try:
        fit.plan, program, _, _ = plan_step(local, budget, tiles=tiles, **args)
    except BudgetError as exc:
        fit.least, fit.why, fit.verdict = exc.least_peak_bytes, str(exc), False
        return
    values, saved, _ = _profile(program, step.target)
    fit.saved = int(saved[int(np.argmax(values))])
    dev = device_for(step.target, step.host_bandwidth)
    fit.seconds = sum(eqn_cost(e, dev).seconds for g in (program.forward, program.backward) for e in g.eqns)
    fit.comm = comm_bytes(program)

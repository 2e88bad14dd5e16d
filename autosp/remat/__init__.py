"""Sequence-aware activation checkpointing: one ILP over the joint graph chooses, for every
forward value the backward reads, to save, recompute or offload it under a memory budget.

    joint    passes/autodiff.py   the sharded forward differentiated into one IR program
    model    liveness.py          bytes per rank over the executed order (storage-aware)
             cost.py              seconds per equation (FLOPs, bytes, links)
    problem  problem.py           IlpProblem: variables, availability rows, memory intervals
    solve    solve.py             HiGHS with lazy memory rows; brute force for tests
    seeds    cuts.py              per-layer checkpointing at the dataflow's cuts, simulated beside the ILP
    apply    apply.py             the plan -> forward and backward programs
    plan     plan.py              Plan (data, printable), the budget loop, simulate_step
    keep     store.py             plans kept on disk, keyed by what they are a function of
    run      runtime.py           the programs as one autograd.Function
"""
from __future__ import annotations

import os

from autosp.remat.plan import BudgetError, Decision, Plan, make_plan, parse_budget, parse_host_memory, simulate_step

__all__ = ["BudgetError", "Decision", "Plan", "compile_step", "make_plan", "parse_budget", "parse_host_memory",
           "plan_step", "simulate_step"]


_JOINTS: dict = {}          # the last few joint graphs, by the sharded graph they differentiate: (boundary,
                            # joint, program_key)
_KEEP = 12                  # autosp plan's: no SP and SP untiled at two lengths, the search's tiled ones, a check's


def joint_of(local):
    """(StepBoundary, Joint) of a sharded forward graph, cached: planning the same step under several
    budgets traces its backward once, and the same step at another length (the planner's second
    probe) re-instantiates the joint it has (passes/rescale.py) instead of differentiating again."""
    from autosp.passes.autodiff import differentiate, split_boundary
    from autosp.passes.rescale import RescaleError, program_key, rescale
    text = str(local)
    key = (text, tuple(id(t) for _, t in local.consts))
    hit = _JOINTS.get(key)
    if hit is None:
        boundary = split_boundary(local)
        shape = program_key(text)
        for b, j, other in reversed(_JOINTS.values()):
            if other == shape:
                try:
                    hit = (boundary, rescale(j, b.graph, boundary.graph), shape)
                    break
                except RescaleError:
                    continue
        if hit is None:
            hit = (boundary, differentiate(boundary.graph), shape)
        if len(_JOINTS) >= _KEEP:
            _JOINTS.pop(next(iter(_JOINTS)))
        _JOINTS[key] = hit
    return hit[:2]


def export_joints(since: int = 0) -> bytes:
    """The joints this process has derived (from the `since`-th kept on: joint_count() before deriving the ones to
    hand over), as bytes (ir/serial.py) for another process to adopt_joints: `autosp plan`'s search process hands
    them to the one that checks its answer, which then re-instantiates them at each length it asks
    (passes/rescale.py, 1.5-2.5 s for the 8B step) instead of differentiating (passes/segments.py: 1 s untiled,
    4 s tiled)."""
    from autosp.ir.serial import dumps
    return dumps(list(_JOINTS.values())[since:])


def joint_count() -> int:
    """How many joints this process keeps (export_joints' `since`)."""
    return len(_JOINTS)


def adopt_joints(data: bytes) -> None:
    """Joints another process derived (export_joints), kept for joint_of to re-instantiate."""
    from autosp.ir.serial import loads
    for entry in loads(data):
        if len(_JOINTS) >= _KEEP:
            _JOINTS.pop(next(iter(_JOINTS)))
        _JOINTS[("adopted", entry[2])] = tuple(entry)


def tiling_levels(chains, levels: int = 6) -> list[dict[str, int]]:
    """The tilings the planner tries, least first: none, then each chain (MLPs and the loss head) in as
    many tiles (powers of two, at most Chain.k_max) as hold its widest value within a threshold that
    falls fourfold per level, from a quarter of the widest value of all."""
    out: list[dict[str, int]] = [{}]
    # a norm's fp32 values are twice its bf16 input and live only inside it: tiling them (k = 2) lowers no
    # peak we measured and doubles the norm's share of the plan, so only tiles= tiles them
    chains = [c for c in chains if not c.name.startswith("norm")]
    if not chains:
        return out
    widest = max(c.wide_bytes for c in chains)
    for j in range(1, levels + 1):
        limit = widest / 4 ** j
        ks = {}
        for c in chains:
            k, top = 1, c.k_max()
            while c.wide_bytes / k > limit and k < top:
                k *= 2
            if k > 1:
                ks[c.id] = k
        if ks and ks != out[-1]:
            out.append(ks)
    return out


_TILED: dict = {}           # the last few tiled graphs: (id of the graph, tiling) -> (graph, tiled graph)


def _tiled(local, ks: dict, chains):
    """tile(local, ks, chains), cached: the planner's rounds (autosp plan's host capacities) tile one step alike."""
    from autosp.passes.tile import tile
    key = (id(local), tuple(sorted(ks.items())))
    hit = _TILED.get(key)
    if hit is None or hit[0] is not local:
        hit = (local, tile(local, ks, chains))
        if len(_TILED) >= 4:
            _TILED.pop(next(iter(_TILED)))
        _TILED[key] = hit
    return hit[1]


def _by_id(tiles: dict, chains) -> dict[str, int]:
    """A tiling by chain name ('loss', 'mlp' for every MLP, 'mlp.3') -> by Chain.id."""
    from autosp.errors import AutospError
    names = {c.name for c in chains} | {c.name.split(".")[0] for c in chains}
    unknown = sorted(set(tiles) - names)
    if unknown:
        found = ", ".join(c.name for c in chains) or "none"
        raise AutospError(f"tiles={tiles!r}: no chain named {', '.join(map(repr, unknown))} in this program (chains "
                          f"found: {found}). Fix: name chains as autosp.explain prints them, 'mlp' for every MLP.")
    out = {}
    for c in chains:
        k = tiles.get(c.name, tiles.get(c.name.split(".")[0], 1))
        if k > 1:
            out[c.id] = k
    return out


def _planned(local, memory_budget, dev, *, host_memory=None, refine: bool = True, tiles=None,
             plan_only: bool = False, attention=None, enough=None):
    """(Plan, Program, Joint, StepBoundary, tiling) of the step under the budget (_plan_now), or of the plan
    kept on disk for the same step and arguments (store.py: the joint derived again, the plan applied to it and
    simulated again; with `plan_only`, none of it: Program, Joint and StepBoundary are None, and the peak is the
    stored one); a refusal kept is raised again."""
    from dataclasses import replace

    from autosp.remat import store
    from autosp.remat.solve import time_limits
    name = store.key(local, memory_budget, dev, host_memory=host_memory, refine=refine, tiles=tiles,
                     attention=attention, enough=enough)
    kept = store.load(name)
    if kept is not None and kept[0] == "refused":
        raise BudgetError(kept[1], least_peak_bytes=kept[2])
    if kept is not None:
        if plan_only:
            return kept[1], None, None, None, kept[5]
        plan, program, joint, boundary, ks = _applied(local, *kept[1:])
        # the peak the run is held to is the memory model's of the program it runs, not the file's
        plan = replace(plan, peak_bytes=int(simulate_step(program, dev.name).peak))
        return plan, program, joint, boundary, ks
    limited = time_limits()
    try:
        plan, program, joint, boundary, ks = _plan_now(local, memory_budget, dev, host_memory=host_memory,
                                                       refine=refine, tiles=tiles, attention=attention,
                                                       enough=enough)
    except BudgetError as exc:
        if time_limits() == limited:
            store.save(name, ("refused", str(exc), exc.least_peak_bytes))
        raise
    if time_limits() == limited:
        store.save(name, ("plan", plan, tuple(program.saved), _recomputed(joint, program), tuple(program.offloaded),
                          ks))
    return plan, program, joint, boundary, ks


def _applied(local, plan, saved, recomputed, offloaded, ks):
    """_planned's result for a plan made elsewhere (the planning rank's broadcast, or the plan cache)."""
    from autosp.passes.tile import tile
    from autosp.remat.apply import apply_plan
    boundary, joint = _joint(tile(local, ks) if ks else local, plan.attention_backward)
    return plan, apply_plan(joint, saved, recomputed, offloaded), joint, boundary, ks


def _joint(local, attention: str = "sdpa"):
    """(StepBoundary, Joint) of `local` with its attention backwards run by `attention`'s kernels: 'sdpa' (the
    backend's, as traced) or 'autosp' (passes/attention_backward.py)."""
    boundary, joint = joint_of(local)
    if attention == "autosp":
        from autosp.passes.attention_backward import with_autosp_backward
        joint = with_autosp_backward(joint)
    return boundary, joint


def _widest(graph) -> int:
    """The bytes of the widest value a program's equations make."""
    return max((v.nbytes() for e in graph.eqns for v in e.outputs), default=0)


def _attention_bound(program, device: str) -> bool:
    """Whether an attention backward's own scratch reaches the step's peak: one whose memory while it runs, less
    what autosp's kernel would save there, is within that saving of the peak (else the kernel cannot lower it)."""
    from autosp.kernels.sdpa_backward import scratch_bytes
    from autosp.passes.attention_backward import eligible
    from autosp.passes.schedule import schedule_program
    from autosp.remat import liveness
    mem = simulate_step(program, device)
    for e, during in zip(schedule_program(program).backward.eqns, mem.backward.during):
        if eligible(e):
            saving = liveness.workspace(e, device) - scratch_bytes(e.inputs[1], e.inputs[2], "cuda")
            if saving > 0 and during >= mem.peak - saving:
                return True
    return False


def attention_kernels(local, dev, attention=None) -> tuple[str, ...]:
    """The attention backward kernels the planner weighs for a step on `dev`: SDPA's backend alone on the CPU
    (its scratch is per thread) or where no attention backward could run otherwise; on a GPU also autosp's, whose
    scratch is two fp32 rows per query row against the backend's fp32 dQ and GQA copies. `attention` forces one."""
    if attention is not None:
        return (attention,)
    if dev.kind == "cpu":
        return ("sdpa",)
    from autosp.passes.attention_backward import candidates
    return ("sdpa", "autosp") if candidates(local) else ("sdpa",)


def _plan_now(local, memory_budget, dev, *, host_memory=None, refine: bool = True, tiles=None, attention=None,
              enough=None):
    """(Plan, Program, Joint, StepBoundary, tiling) of the step under the budget: untiled first, then
    the tilings of tiling_levels (passes/tile.py) until a plan fits (`tiles`: that tiling alone, by
    chain name). "least": the lower of the untiled step's and the most tiled one's least peaks (each with the
    backend's attention backward, and autosp's where that may lower it); a budget none reaches is refused with
    that least. `enough` (a verdict's budget, with "least"): the first of those whose peak and constants are
    within it, the others not searched (train's planner, given that budget, finds a plan within it then too).
    A fraction is of the untiled no-remat peak."""
    from autosp.passes.tile import find_chains
    offload = dev.host_bw is not None
    chains = find_chains(local)
    if tiles is not None:
        levels = [_by_id(tiles, chains)]
    elif memory_budget is None or not chains:
        levels = [{}]
    else:
        levels = tiling_levels(chains)
    kind, amount = parse_budget(memory_budget) if memory_budget is not None else (None, None)
    by_id = {c.id: c for c in chains}
    from dataclasses import replace

    kernels = attention_kernels(local, dev, attention)

    def at(ks, budget, search=True, kernel=kernels[0], defer=False):
        """The plan at tiling `ks` with `kernel`; `defer`: a least-peak plan with, last, the call that makes the
        cheapest plan at its peak (make_plan's `deferred`), or None where there is none to make."""
        boundary, joint = _joint(_tiled(local, ks, chains) if ks else local, kernel)
        later = [] if defer else None
        made = make_plan(joint, budget, dev, offload=offload, host_memory=host_memory, refine=refine,
                         search=search, deferred=later, enough=enough if kind == "least" else None)

        def done(made):
            plan, program = made
            return _with_tiling(replace(plan, attention_backward=kernel), ks, by_id), program, joint, boundary, ks
        if not defer:
            return done(made)
        return done(made) + ((lambda: done(later[0]())) if later else None,)

    def first_fit(ks, budget, search=True):
        """The plan at tiling `ks` with the first kernel that fits the budget (the backend's first: it is faster)."""
        for kernel in kernels[:-1]:
            try:
                return at(ks, budget, search, kernel)
            except BudgetError:
                continue
        return at(ks, budget, search, kernels[-1])

    if kind == "least":                          # the most tiles usually, but not where tiling costs more
        ends = [levels[-1]] if levels[0] == levels[-1] else [levels[-1], levels[0]]
        found = []
        helper = _helper(local, chains, ends, kernels, enough, at, memory_budget, dev)

        def search(ks, kernel):
            """at(ks) with `kernel`, or the helper's answer for that end (helper.py): (plan, None, None, None, ks,
            None, its decisions, whether attention's scratch holds it up)."""
            nonlocal helper
            if helper is not None and helper.end == (tuple(sorted(ks.items())), kernel):
                got, helper = helper.take(), None
                if got is not None:
                    plan, decisions, bound = got
                    return plan, None, None, None, ks, None, decisions, bound
            return at(ks, memory_budget, kernel=kernel, defer=True)

        def within():
            return enough is not None and any(r[0].peak_bytes + r[0].const_bytes <= enough for r in found)
        try:
            for ks in ends:
                if within():
                    break
                # every forward equation runs, so no plan's peak is below the widest value the forward makes: a
                # tiling whose widest value is above a least found already is not searched (the untiled step's
                # logits at long context)
                if found and _widest(_tiled(local, ks, chains) if ks else local) >= found[0][0].peak_bytes:
                    continue
                found.append(search(ks, kernels[0]))
            # autosp's attention backward, where the backend's scratch is what holds a least peak up
            if not within():
                found += [search(r[4], kernel) for r in list(found)
                          if (r[7] if len(r) > 7 else _attention_bound(r[1], dev.name)) for kernel in kernels[1:]]
        finally:
            if helper is not None:
                helper.stop()
        # the lower least; at a tie the backend's kernel and the fewer tiles (both faster)
        best = min(found, key=lambda r: (r[0].peak_bytes, r[0].attention_backward != kernels[0], sum(r[4].values())))
        if len(best) > 6:                        # the helper's: its programs, derived here
            from autosp.remat.apply import apply_plan
            boundary, joint = _joint(_tiled(local, best[4], chains) if best[4] else local,
                                     best[0].attention_backward)
            return best[0], apply_plan(joint, *best[6]), joint, boundary, best[4]
        # its cheapest plan at that peak (the cost-minimising solve), for the lower end alone: MiniMax's at 128
        # tokens took 15-23 s a solve, half of train's planning
        return best[5]() if best[5] is not None else best[:5]
    budget = memory_budget
    if kind == "fraction" and len(levels) > 1:
        whole = make_plan(_joint(local, kernels[0])[1], None, dev, offload=offload, host_memory=host_memory)[0]
        budget = int(amount * whole.no_remat_peak_bytes)
    for ks in levels[:-1]:                       # the budget's solves alone: the first tiling that fits
        try:
            return first_fit(ks, budget, search=False)
        except BudgetError:
            continue
    try:
        return first_fit(levels[-1], budget)
    except BudgetError as exc:
        if not levels[-1]:
            raise
        refused = exc
    try:                                         # the untiled step's least may be the lower one
        return first_fit(levels[0], budget)
    except BudgetError as exc:
        least = min(refused.least_peak_bytes, exc.least_peak_bytes)
        what = ", ".join(f"{by_id[i].name} in {k} tiles" for i, k in levels[-1].items())
        first = refused if refused.least_peak_bytes <= exc.least_peak_bytes else exc
        raise BudgetError(f"{first} (Tiled along the sequence as far as autosp goes, {what}, and untiled.)",
                          least_peak_bytes=least) from None


def _helper(local, chains, ends, kernels, enough, at, budget, dev):
    """A verdict's next end searched beside it (helper.py) where a core is to be idle for it: the untiled step
    where its widest value is within the budget (else it cannot be a least within it), else autosp's attention
    backward on the most tiled step; None where the search has one end, or is not a verdict's."""
    from autosp.remat.helper import PEER_IDLE, Helper
    if enough is None or PEER_IDLE[0] is None or not hasattr(os, "fork"):
        return None
    if len(ends) > 1 and _widest(_tiled(local, ends[1], chains) if ends[1] else local) < enough:
        ks, kernel = ends[1], kernels[0]
    elif len(kernels) > 1:
        ks, kernel = ends[0], kernels[1]
        _joint(_tiled(local, ks, chains) if ks else local)     # the search's first joint, derived once for both
    else:
        return None

    def work():
        plan, program, joint, _, _, _ = at(ks, budget, kernel=kernel, defer=True)
        bound = kernel == kernels[0] and len(kernels) > 1 and _attention_bound(program, dev.name)
        return plan, (tuple(program.saved), _recomputed(joint, program), tuple(program.offloaded)), bound
    return Helper((tuple(sorted(ks.items())), kernel), work, PEER_IDLE[0])


def _with_tiling(plan, ks: dict, by_id: dict):
    """The plan with Plan.tiling filled in: (chain, tiles, widest value whole, per tile)."""
    from dataclasses import replace

    from autosp.passes.tile import tile_sizes
    if not ks:
        return plan
    return replace(plan, tiling=tuple((by_id[i].name, k, by_id[i].wide_bytes,
                                       by_id[i].wide_bytes * max(tile_sizes(by_id[i].length, k)) // by_id[i].length)
                                      for i, k in ks.items()))


def plan_step(local, memory_budget, *, device: str = "cpu", host_bandwidth=None, host_memory=None,
              offload: bool | None = None, refine: bool = True, tiles=None, plan_only: bool = False,
              attention=None, enough=None):
    """(Plan, Program, Joint, StepBoundary) for a sharded forward graph; runs nothing. The one planning
    entry of autosp.plan, autosp.explain and the command line. `offload`: None plans offload where the
    device has a host link (a GPU, or `host_bandwidth`), False never; `host_memory`: bytes per rank
    (or '64GiB') the offloaded values may take, None no limit; `refine`: make_plan's; `tiles`: a
    tiling to plan with (Chain.id -> k) instead of the search; `plan_only`: the Plan is all the caller
    reads (a plan kept on disk is then not applied: the others may be None); `attention`: the attention
    backward's kernel, 'sdpa' or 'autosp' (None: the planner weighs both on a GPU, attention_kernels); `enough`:
    with "least", bytes a least-peak plan may stop at (_plan_now)."""
    from dataclasses import replace

    from autosp.remat.cost import device_for
    dev = device_for(device, host_bandwidth)
    if offload is False:
        dev = replace(dev, host_bw=None)
    plan, program, joint, boundary, _ = _planned(local, memory_budget, dev, host_memory=host_memory, refine=refine,
                                                 tiles=tiles, plan_only=plan_only, attention=attention,
                                                 enough=enough)
    return plan, program, joint, boundary


def compile_step(local, memory_budget, *, device: str = "cpu", host_bandwidth=None, host_memory=None,
                 group: str | None = None, tiles=None, compiled: bool = False, attention=None):
    """(Plan, runner): the step that runs the plan. With a process group, its first rank plans and
    broadcasts the plan (recomputed collectives must match across ranks, and a shared host plans
    once); a refused budget is raised on every rank. `compiled`: the programs through inductor."""
    import torch.distributed as dist
    from autosp.collectives import _pg, broadcast_object
    from autosp.remat.apply import apply_plan
    from autosp.remat.cost import device_for
    from autosp.remat.runtime import Runner
    dev = device_for(device, host_bandwidth)
    pg = _pg(group) if group is not None else None
    if pg is None or dist.get_world_size(pg) == 1:
        plan, program, joint, boundary, _ = _planned(local, memory_budget, dev, host_memory=host_memory,
                                                     tiles=tiles, attention=attention)
        return plan, Runner(program, joint, boundary, compiled, dev.name)
    box = [None]
    if dist.get_rank(pg) == 0:
        try:
            plan, program, joint, boundary, ks = _planned(local, memory_budget, dev, host_memory=host_memory,
                                                          tiles=tiles, attention=attention)
            recomputed = _recomputed(joint, program)
            box = [(plan, tuple(program.saved), recomputed, tuple(program.offloaded), ks,
                    _joint_to_send(boundary, local))]
        except Exception as exc:  # noqa: BLE001 - every rank raises what the planning rank raised
            box = [exc]
    box = [broadcast_object(box[0], pg)]
    if isinstance(box[0], Exception):
        raise box[0]
    if dist.get_rank(pg) != 0:                   # the same tiling, then the same plan
        sent = box[0][5]                         # the planning rank's joint, re-instantiated on this rank's step
        if sent is not None and sent[0] == _printed_digest(local):
            adopt_joints(sent[1])
        plan, program, joint, boundary, _ = _applied(local, *box[0][:5])
    else:                                        # applied as the others apply it
        program = apply_plan(joint, *box[0][1:4])
    return plan, Runner(program, joint, boundary, compiled, dev.name)


def _joint_to_send(boundary, local) -> tuple[str, bytes] | None:
    """The joint the planning rank derived for the step it planned (export_joints' form) with the digest of its step as
    printed, for the other ranks of its group: a rank whose step prints the same (the same program, its constants its
    own) re-instantiates it (joint_of: passes/rescale.py, a fraction of differentiating it; the tiny preset's step
    0.3 s against 2.1 s a rank); one whose step differs (another dp row's group names, a ring's rank-dependent
    arguments) differentiates its own. None where it is not kept."""
    from autosp.ir.serial import dumps
    mine = [entry for entry in _JOINTS.values() if entry[0] is boundary]
    return (_printed_digest(local), dumps(mine[-1:])) if mine else None


def _printed_digest(graph) -> str:
    import hashlib
    return hashlib.sha256(str(graph).encode()).hexdigest()


def _recomputed(joint, program) -> tuple[int, ...]:
    fwd = set(program.backward.eqns)
    return tuple(k for k, e in enumerate(joint.forward_eqns) if e in fwd)

"""Collectives started early and waited late (Graph -> Graph), on each program of a planned step.

    keys_first(g)          attention's all-to-all of Q, K and V as two, K and V's first, Q's work between them
    split_collectives(g)   each all_to_all, all_gather_param and reduce_scatter_param becomes a start, a wait
                           and what makes its result from its buffers (autosp.inflight), in its place
    place_collectives(g)   starts moved up to where their inputs exist, waits down to the first use of the result
    schedule_program(p)    both on the forward and backward programs of a remat.Program (the backward's regathered
                           parameters first gathered a layer ahead, as passes/prefetch does for the forward)

What moves where:
- K and V go out while Q is projected and rotated (keys_first);
- an all-to-all starts right after the last of its inputs is made and is waited right before the first equation
  that reads one of its outputs (attention's gradient all-to-alls hide nothing: the weight gradient beside the
  first runs before its start, and only views are left between; tests/test_schedule.py holds each kind's share);
- a parameter's gather starts where passes/prefetch put it (a layer ahead) and is waited at the parameter's first
  use; moving it further up would hold more layers gathered than the plan counted;
- a gradient's reduce-scatter starts as soon as the gradient is made, and the reduce-scatters of one layer (the
  parameter name up to its first number) are waited right before the next layer's first one starts, the last
  layer's at the end of the program: one layer's gradients in flight while the next layer's backward runs,
  not the whole model's.

Every rank runs this pass on the same program, so every rank posts the same collectives in the same order. The
buffers in flight are values of the program, so the memory model (remat.liveness) counts them for as long as they
are in flight; remat.plan.simulate_step simulates the scheduled programs, which are what remat.runtime runs.
"""
from __future__ import annotations

import os

import torch

from autosp.ir.core import Eqn, Graph, PerEqn, Role, Var
from autosp.ir.ops import Tag, op_for
from autosp.passes.prefetch import layer_of, schedule_gathers
from autosp.units import fmt_bytes

aten = torch.ops.aten
STARTS = ("all_to_all_start", "all_gather_param_start", "reduce_scatter_param_start")


def _ops():
    from autosp import inflight
    return inflight


def _buffer(v: Var, suffix: str, shape, dtype) -> Var:
    return Var(f"{v.name}.{suffix}", dtype, tuple(shape), v.device)


def _split_all_to_all(e: Eqn, group: str) -> list[Eqn]:
    a = e.bind_schema()
    xs, scatter, gather = a["xs"], a["scatter_dim"], a["gather_dim"]
    n = sum(x.numel() for x in xs)
    first = e.outputs[0]
    send, recv = _buffer(first, "send", (n,), xs[0].dtype), _buffer(first, "recv", (n,), xs[0].dtype)
    ndim = xs[0].ndim
    shapes = [d for x in xs for d in x.shape]
    io = _ops()
    return [Eqn.make(op_for(io.all_to_all_start), (list(xs), scatter, gather, group), {}, (send, recv), multi=True,
                     source=e.source),
            Eqn.make(op_for(io.wait_collective), ([send, recv],), {}, ()),
            Eqn.make(op_for(io.all_to_all_unpack), (recv, shapes, ndim, scatter, gather, group), {}, e.outputs,
                     multi=True, source=e.source)]


def _split_gather(e: Eqn, group: str) -> list[Eqn]:
    from autosp.remat.liveness import _ranks
    a = e.bind_schema()
    x, rows, dtype = a["x"], a["rows"], a["dtype"]
    p = _ranks(e, 2, x.shape[0], rows)           # a program simulated away from its process group: from its rows
    param = e.outputs[0]
    send = _buffer(param, "send", x.shape, dtype)
    full_shape = (p * x.shape[0],) + tuple(x.shape[1:])
    out = param if full_shape[0] == rows else _buffer(param, "gathered", full_shape, dtype)
    io = _ops()
    eqns = [Eqn.make(op_for(io.all_gather_param_start), (x, group, dtype), {}, (send, out), multi=True,
                     source=e.source),
            Eqn.make(op_for(io.wait_collective), ([send, out],), {}, ())]
    if out is not param:              # the padding rows dropped: a view of the gathered buffer
        eqns.append(Eqn.make(op_for(aten.slice.Tensor), (out, 0, 0, rows), {}, (param,)))
    return eqns


def _split_reduce_scatter(e: Eqn, group: str) -> list[Eqn]:
    from autosp.remat.liveness import _ranks
    a = e.bind_schema()
    g, chunk, reduce_dtype, dtype = a["g"], a["chunk"], a["reduce_dtype"], a["dtype"]
    p = _ranks(e, 2, chunk, g.shape[0])
    grad = e.outputs[0]
    rest = tuple(g.shape[1:])
    full = _buffer(grad, "full", (p * chunk,) + rest, reduce_dtype)
    out = grad if reduce_dtype == dtype else _buffer(grad, "reduced", (chunk,) + rest, reduce_dtype)
    io = _ops()
    eqns = [Eqn.make(op_for(io.reduce_scatter_param_start), (g, chunk, group, reduce_dtype), {}, (full, out),
                     multi=True, source=e.source),
            Eqn.make(op_for(io.wait_collective), ([full, out],), {}, ())]
    if out is not grad:               # the shard's own dtype
        eqns.append(Eqn.make(op_for(aten._to_copy.default), (out,), {"dtype": dtype}, (grad,)))
    return eqns


# op name -> its start, wait and result equations
SPLIT = {
    "all_to_all": _split_all_to_all,
    "all_gather_param": _split_gather,
    "reduce_scatter_param": _split_reduce_scatter,
}


_SPLIT = PerEqn()    # each collective's split: the planner schedules many programs made of the same equations


def split_collectives(graph: Graph) -> Graph:
    """Each blocking collective of SPLIT as start, wait and result, where it stood (nothing moves yet)."""
    if not any(e.op.name in SPLIT for e in graph.eqns):
        return graph
    eqns = []
    for e in graph.eqns:
        rule = SPLIT.get(e.op.name)
        if rule is None:
            eqns.append(e)
            continue
        eqns.extend(_SPLIT.get(e, _split, rule))
    return graph.replace(eqns=tuple(eqns), name="split_collectives")


def _split(e: Eqn, rule) -> tuple:
    return tuple(rule(e, e.bind_schema()["group_name"]))


def keys_first(graph: Graph) -> Graph:
    """Attention's all-to-all of [Q, K, V] (sequence -> heads; the sharding pass emits Q first) as two: K and V's,
    then Q's, with the equations only Q needs moved between them, so that K and V are in flight while Q is
    projected (and rotated). Kept whole where Q's work cannot be moved after K's and V's (it feeds them)."""
    eqns = list(graph.eqns)
    changed = False
    a = 0
    while a < len(eqns):
        e = eqns[a]
        a += 1
        if e.op.name != "all_to_all" or len(e.inputs) != 3:
            continue
        args = e.bind_schema()
        if args["scatter_dim"] >= args["gather_dim"]:
            continue
        at = a - 1
        lo = next((j + 1 for j in range(at - 1, -1, -1) if eqns[j].op.has(Tag.COLLECTIVE)), 0)
        producer = {o.name: j for j in range(lo, at) for o in eqns[j].outputs}
        q, k, v = e.inputs
        kv, mine = _cone(eqns, producer, (k, v)), _cone(eqns, producer, (q,))
        moved = mine - kv
        if not moved:
            continue
        for j in range(min(moved), at):          # and what reads Q's work before the all-to-all
            if j not in moved and any(producer.get(x.name) in moved for x in eqns[j].inputs):
                moved.add(j)
        if moved & kv:
            continue
        from autosp import collectives as C
        group = args["group_name"]
        sd, gd = args["scatter_dim"], args["gather_dim"]
        oq, ok, ov = e.outputs
        first = Eqn.make(op_for(C.all_to_all), ([k, v], sd, gd, group), {}, (ok, ov), multi=True, source=e.source)
        second = Eqn.make(op_for(C.all_to_all), ([q], sd, gd, group), {}, (oq,), multi=True, source=e.source)
        start = min(moved)
        window = [eqns[j] for j in range(start, at) if j not in moved] + [first] + \
                 [eqns[j] for j in sorted(moved)] + [second]
        eqns[start:at + 1] = window
        a = start + len(window)
        changed = True
    return graph.replace(eqns=tuple(eqns), name="keys_first") if changed else graph


def _cone(eqns: list, producer: dict, roots) -> set[int]:
    """Indices of the equations (of those in `producer`) that the values `roots` depend on."""
    out, todo = set(), [producer[x.name] for x in roots if x.name in producer]
    while todo:
        j = todo.pop()
        if j in out or eqns[j].op.has(Tag.COLLECTIVE):
            continue
        out.add(j)
        todo.extend(producer[x.name] for x in eqns[j].inputs if x.name in producer)
    return out


def _groups(graph: Graph) -> list[tuple[int, int]]:
    """(start index, wait index) of every posted collective; the wait's result equations follow it."""
    posted = {}
    out = []
    for k, e in enumerate(graph.eqns):
        if e.op.name in STARTS:
            posted[e.outputs[-1].name] = k
        elif e.op.name == "wait_collective":
            out.append((posted[e.inputs[-1].name], k))
    return out


def _result_eqns(eqns: list, k: int) -> list:
    """The wait at k and the equations after it that only read its buffers (the unpack, the slice, the cast)."""
    wait = eqns[k]
    bufs = {x.name for x in wait.inputs}
    block = [wait]
    j = k + 1
    while j < len(eqns) and eqns[j].op.name not in STARTS and eqns[j].op.name != "wait_collective" and \
            eqns[j].inputs and all(x.name in bufs for x in eqns[j].inputs):
        block.append(eqns[j])
        j += 1
    return block


def _grad_layers(graph: Graph) -> dict[str, str]:
    """A backward program's gradient output name -> its parameter's layer (outputs follow the PARAM inputs)."""
    params = [v for v in graph.inputs if v.role is Role.PARAM]
    outs = [o for o in graph.outputs if isinstance(o, Var)]
    if len(params) != len(outs):
        return {}
    return {o.name: layer_of(p.name) for p, o in zip(params, outs)}


def place_collectives(graph: Graph) -> Graph:
    """Starts up to their inputs, then waits down to their first reader (reduce-scatters: before the next layer's
    first start, as the starts then stand). The scans compare each equation's input names as one frozenset (C
    speed): an 8B program's 20K equations were 0.9 s a call in Python's any(), half of a verdict's planning."""
    eqns = list(graph.eqns)
    if not any(e.op.name == "wait_collective" for e in eqns):
        return graph
    reads = {id(e): _reads(e) for e in eqns}
    n_readers: dict[str, int] = {}
    for e in eqns:
        for name in reads[id(e)]:
            n_readers[name] = n_readers.get(name, 0) + 1
    # starts, first first: each right after the equation making the last of its inputs (a later start made ready by
    # the same equation goes before an earlier one: each was inserted right after it in turn)
    made_at: dict[str, int] = {}
    after: dict[int, list] = {}
    for i, e in enumerate(eqns):
        if e.op.name in ("all_to_all_start", "reduce_scatter_param_start"):
            after.setdefault(max((made_at.get(n, -1) for n in reads[id(e)]), default=-1), []).append(e)
        else:
            for o in e.outputs:
                made_at[o.name] = i
    if after:
        moved = [*reversed(after.get(-1, ()))]
        for i, e in enumerate(eqns):
            if e.op.name not in ("all_to_all_start", "reduce_scatter_param_start"):
                moved.append(e)
                moved.extend(reversed(after.get(i, ())))
        eqns = moved
    # waits, latest first: each block (wait and its results) goes right before the first equation reading a result;
    # a reduce-scatter's (whose result only the program's end reads) before the next layer's first start
    finals = {o.name for o in graph.outputs if isinstance(o, Var)}
    starts = {x.outputs[-1].name: x for x in eqns if x.op.name in STARTS}     # a wait's landing buffer -> its start
    layer_of_grad = _grad_layers(graph)
    k, placed = len(eqns) - 1, set()
    while k >= 0:
        e = eqns[k]
        if e.op.name != "wait_collective" or id(e) in placed:
            k -= 1
            continue
        placed.add(id(e))
        block = _result_eqns(eqns, k)
        made = {o.name for b in block for o in b.outputs} | reads[id(e)]
        starter = starts.get(e.inputs[-1].name)
        rs = starter is not None and starter.op.name == "reduce_scatter_param_start"
        del eqns[k:k + len(block)]
        inside = {}
        for b in block:
            for name in reads[id(b)]:
                inside[name] = inside.get(name, 0) + 1
        if all(n_readers.get(name, 0) <= inside.get(name, 0) for name in made):
            at = len(eqns)            # nothing outside the block reads what it makes (a gradient the end returns)
        else:
            at = next((j for j in range(k, len(eqns)) if not made.isdisjoint(reads[id(eqns[j])])), len(eqns))
        if rs and at == len(eqns):    # from its start on (a reduce-scatter's wait may move up, its reader is the end)
            since = next(j for j in range(k - 1, -1, -1) if eqns[j] is starter) + 1
            at = _next_layer_start(eqns, since, layer_of_grad, made & finals)
        eqns[at:at] = block
        if at >= k:                   # moved down or stayed: the next to look at is below; moved up: it is at k now
            k -= 1
    return graph.replace(eqns=tuple(eqns), name="place_collectives")


_READS = PerEqn()    # each equation's input names as one frozenset


def _reads(e: Eqn) -> frozenset:
    return _READS.get(e, _names_read)


def _names_read(e: Eqn) -> frozenset:
    return frozenset(x.name for x in e.inputs)


def _next_layer_start(eqns: list, k: int, layers: dict, grads: set) -> int:
    """Where a reduce-scatter's wait goes: before the first reduce-scatter start after k of another layer (every
    one after it where the layers are not known)."""
    mine = {layers.get(n) for n in grads} - {None}
    for j in range(k, len(eqns)):
        e = eqns[j]
        if e.op.name != "reduce_scatter_param_start":
            continue
        theirs = layers.get(e.outputs[-1].name.removesuffix(".reduced"))
        if not mine or theirs not in mine:
            return j
    return len(eqns)


def schedule(graph: Graph) -> Graph:
    """keys_first, split_collectives, then place_collectives."""
    return place_collectives(split_collectives(keys_first(graph)))


def enabled() -> bool:
    """AUTOSP_OVERLAP=0 runs every collective where it stands, blocking (a benchmark's other side)."""
    return os.environ.get("AUTOSP_OVERLAP", "1") != "0"


def schedule_program(program):
    """A remat.Program with both programs scheduled (idempotent: a scheduled program has nothing left to split)."""
    from dataclasses import replace
    if not enabled():
        return program
    fwd = schedule(program.forward)
    bwd = program.backward
    if bwd is not None:
        if any(e.op.name == "all_gather_param" for e in bwd.eqns):
            bwd = schedule_gathers(bwd)
        bwd = schedule(bwd)
    if fwd is program.forward and bwd is program.backward:
        return program
    named = lambda g, was: g if g is None or g is was else g.replace(name=f"{was.name} (scheduled)")  # noqa: E731
    return replace(program, forward=named(fwd, program.forward), backward=named(bwd, program.backward))


# ---------------------------------------------------------------- what explain shows

def does_work(e: Eqn) -> bool:
    """Whether `e`, run between a collective's start and its wait, is compute the transfer can hide under: not
    another start or wait, and not a view (its outputs alias its inputs: detach, view, t, unsqueeze, ...), which the
    cost model prices at nothing."""
    from autosp.ir.aliases import aliases
    if e.op.name in STARTS or e.op.name == "wait_collective":
        return False
    return not (e.outputs and all(a is not None for a in aliases(e)))


def overlaps(graph: Graph, device) -> list[tuple]:
    """Per posted collective of a scheduled program: (kind, start index, wait index, equations of work between
    (does_work: views not counted), bytes moved, seconds of those equations, seconds of the transfer) by the cost
    model (remat.cost)."""
    from autosp.remat.cost import eqn_cost, eqn_terms
    eqns = graph.eqns
    rows = []
    for s, w in _groups(graph):
        e = eqns[s]
        between = [x for x in eqns[s + 1:w] if does_work(x)]
        fixed, _, _, link = eqn_terms(e, device)
        rows.append((e.op.name.removesuffix("_start"), s, w, len(between), int(link),
                     sum(eqn_cost(x, device).seconds for x in between), fixed + link / device.link_bw))
    return rows


def overlap_summary(program, device, full: bool = False) -> str:
    """`autosp explain`'s view of a scheduled step: each kind of collective, where it starts and is waited and the
    work between (`full`: one line per collective)."""
    program = schedule_program(program)
    lines = ["# collectives started early, waited late (each: start -> wait, the work between; seconds by the cost "
             f"model of {device.name})"]
    for part, graph in (("forward", program.forward), ("backward", program.backward)):
        if graph is None:
            continue
        rows = overlaps(graph, device)
        kinds = {}
        for r in rows:
            kinds.setdefault(r[0], []).append(r)
        for kind, rs in kinds.items():
            n_between = sorted(r[3] for r in rs)
            hidden = sum(min(r[5], r[6]) for r in rs)
            total = sum(r[6] for r in rs)
            lines.append(f"  {part} {kind} x{len(rs)}: {fmt_bytes(sum(r[4] for r in rs))} moved; "
                         f"{n_between[len(n_between) // 2]} equations of work between start and wait (median, "
                         f"{n_between[0]}-{n_between[-1]}; views not counted); transfer {total * 1e3:.3g} ms, "
                         f"{hidden * 1e3:.3g} ms of it under compute")
            if full:
                lines += [f"    %{graph.eqns[s].outputs[-1].name}: start at {s}, wait at {w}, {k} equations of work "
                          f"between ({t_between * 1e3:.3g} ms), transfer {fmt_bytes(moved)} ({t_link * 1e3:.3g} ms)"
                          for _, s, w, k, moved, t_between, t_link in rs]
    if len(lines) == 1:
        lines.append("  none: this step has no all-to-all, parameter gather or gradient reduce-scatter")
    return "\n".join(lines)

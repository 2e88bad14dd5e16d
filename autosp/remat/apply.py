"""Apply a remat plan to a joint graph: the forward program and the backward program (Graph -> Graphs).

The forward runs the joint's forward equations needed for its outputs and for the values the
plan saves or offloads; it returns the outputs, then the saved values, then the offloaded
host copies (an `offload` right after a value's last forward use). The backward takes the
primals, the saved values, the host copies and the tangents, and runs the joint's backward
equations in autograd's order; a forward value it reads that was not saved is recomputed
just before its first use (its inputs first, recursively), and an offloaded one is fetched
back `prefetch_lead` equations before its first use and waited for right before it.
"""
from __future__ import annotations

from dataclasses import dataclass

from autosp.errors import AutospError
from autosp.ir.core import Eqn, Graph, Role, Var
from autosp.ir.ops import op_for
from autosp.passes.autodiff import Joint
from autosp.passes.dce import dce


@dataclass(frozen=True, slots=True)
class Program:
    forward: Graph        # primals -> forward outputs, saved values, host copies
    backward: Graph | None   # primals, saved values, host copies, tangents -> gradients
    n_outputs: int        # forward outputs first in forward.outputs
    saved: tuple[str, ...]
    offloaded: tuple[str, ...]


def host_name(name: str) -> str:
    return f"{name}@host"


def apply_plan(joint: Joint, saved, recomputed, offloaded=(), prefetch_lead: int = 8,
               backward: bool = True) -> Program:
    """`saved`, `offloaded`: forward var names; `recomputed`: indices of forward equations."""
    from autosp.remat import offload as O
    g = joint.graph
    fwd_eqns = joint.forward_eqns
    producer = {o.name: k for k, e in enumerate(fwd_eqns) for o in e.outputs}
    saved = tuple(dict.fromkeys(n for n in saved if n in producer))
    offloaded = tuple(dict.fromkeys(n for n in offloaded if n in producer))
    recomputed = set(recomputed)

    # ---- forward: DCE to what the outputs, the saved and the offloaded values need
    outs = list(g.outputs[:joint.n_fwd_outputs])
    want = {o.name for o in outs if isinstance(o, Var)} | set(saved) | set(offloaded)
    kept = []
    for e in reversed(fwd_eqns):
        if any(o.name in want for o in e.outputs) or not e.outputs:
            kept.append(e)
            want.update(x.name for x in e.inputs)
    kept.reverse()
    var = {o.name: o for e in kept for o in e.outputs}
    var.update({v.name: v for v in g.inputs})
    last = {}
    for k, e in enumerate(kept):
        for x in e.inputs:
            last[x.name] = k
    made = {o.name: k for k, e in enumerate(kept) for o in e.outputs}
    after: dict[int, list[str]] = {}
    for n in offloaded:
        after.setdefault(max(last.get(n, -1), made[n]), []).append(n)
    eqns, host_vars = [], {}
    for k, e in enumerate(kept):
        eqns.append(e)
        for n in after.get(k, ()):
            v = var[n]
            h = Var(host_name(n), v.dtype, v.shape, "cpu")
            host_vars[n] = h
            eqns.append(Eqn.make(op_for(O.offload), (v,), {}, (h,)))
    primals = g.inputs[:joint.n_primals]
    tangents = g.inputs[joint.n_primals:]
    fwd_out = tuple(outs) + tuple(var[n] for n in saved) + tuple(host_vars[n] for n in offloaded)
    forward = g.replace(inputs=primals, eqns=tuple(eqns), outputs=fwd_out, in_spec=None, out_spec=None,
                        name="remat.forward")
    if not backward:
        return Program(forward, None, joint.n_fwd_outputs, saved, offloaded)

    # ---- backward: autograd's order, recomputations just in time, prefetches ahead
    # views are always redone (they cost nothing and own no memory: their base is what is kept)
    from autosp.ir.aliases import aliases
    free = {k for k, e in enumerate(fwd_eqns) if e.outputs and all(a is not None for a in aliases(e))}
    available = {v.name for v in primals} | set(saved) | {v.name for v, _ in g.consts}
    first_need: dict[str, int] = {}
    bwd: list[Eqn] = []

    def ensure(name: str, stack=()):
        if name in available or name not in producer:
            return
        if name in offloaded:
            first_need.setdefault(name, len(bwd))
            available.add(name)
            return
        k = producer[name]
        if k not in recomputed and k not in free:
            raise AutospError(f"autosp remat: the backward reads {name}, which the plan neither saves, offloads "
                              f"nor recomputes (equation {fwd_eqns[k].format()})")
        if k in stack:
            raise AutospError(f"autosp remat: recomputing {name} needs itself")
        e = fwd_eqns[k]
        for x in e.inputs:
            ensure(x.name, stack + (k,))
        bwd.append(e)
        available.update(o.name for o in e.outputs)

    for e in joint.backward_eqns:
        for x in e.inputs:
            ensure(x.name)
        bwd.append(e)
        available.update(o.name for o in e.outputs)
    # prefetches: issue `prefetch_lead` equations ahead of first use, wait right before it
    issue: dict[int, list[str]] = {}
    waits: dict[int, list[str]] = {}
    for n, j in first_need.items():
        issue.setdefault(max(0, j - prefetch_lead), []).append(n)
        waits.setdefault(j, []).append(n)
    final: list[Eqn] = []
    for j, e in enumerate(bwd + [None]):
        for n in issue.get(j, ()):
            h = host_vars[n]
            final.append(Eqn.make(op_for(O.prefetch), (h,), {"device": var[n].device}, (var[n],)))
        for n in waits.get(j, ()):
            final.append(Eqn.make(op_for(O.wait), (var[n],), {}, ()))
        if e is not None:
            final.append(e)
    grads = g.outputs[joint.n_fwd_outputs:]
    b_inputs = (tuple(primals) + tuple(var[n] for n in saved) + tuple(host_vars[n] for n in offloaded)
                + tuple(tangents))
    kept = (Role.PARAM, Role.FROZEN, Role.INPUT, Role.TANGENT)
    b_inputs = tuple(v if v.role in kept else Var(v.name, v.dtype, v.shape, v.device, role=Role.INPUT)
                     for v in b_inputs)
    bwd_graph = g.replace(inputs=b_inputs, eqns=tuple(final), outputs=tuple(grads), in_spec=None, out_spec=None,
                          name="remat.backward")
    return Program(dce(forward), dce(bwd_graph), joint.n_fwd_outputs, saved, offloaded)

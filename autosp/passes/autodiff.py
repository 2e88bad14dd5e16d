"""Differentiate a sharded forward into one joint program (forward, then backward) in the IR.

    step = split_boundary(local)        # grad_sync / grad_scale leave the graph: the runtime applies them
    joint = differentiate(step.graph)   # make_fx over forward + torch.autograd.grad, lifted into the IR

The joint graph's inputs are the forward's inputs (primals) followed by one tangent per
differentiable output (Role.TANGENT); its outputs are the forward's outputs followed by the
gradient of every differentiable input. Its first `boundary` equations are the forward as
autograd ran it; the rest are the backward, in the order torch's autograd engine ran it.
Which forward values the backward keeps (saved, recomputed, offloaded) is decided later by
the remat planner; this pass only makes the program explicit.

The trace is post-dispatch (`linear` becomes `t` + `addmm`, SDPA its backend op) because
the backward only exists at that level; it runs on fake tensors, so it costs no memory.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from autosp.errors import AutospError
from autosp.ir.core import Graph, Role, Var
from autosp.ir.lower import lower

_BOUNDARY_OPS = ("grad_sync", "grad_scale")


@dataclass(frozen=True, slots=True)
class StepBoundary:
    """A sharded forward without its boundary identities, and what they did.

    `sync[i]`: the process groups over which input i's gradient is summed (grad_sync);
    `scale[j]`: the factor on output j's gradient seed (grad_scale), 1.0 where none.
    """
    graph: Graph
    sync: tuple[tuple[int, tuple[str, ...]], ...]
    scale: tuple[float, ...]


def split_boundary(local: Graph) -> StepBoundary:
    """Remove grad_sync (after parameters) and grad_scale (before outputs) from a sharded graph.

    Both are identities forward; their backward (sum of gradient shares, seed scaling) belongs
    to the runtime around the traced region, not inside it.
    """
    sub: dict[str, Var] = {}
    sync: dict[str, tuple[str, ...]] = {}
    scale: dict[str, float] = {}
    eqns = []
    inputs = {v.name for v in local.inputs}
    for e in local.eqns:
        if e.op.name in _BOUNDARY_OPS:
            src = sub.get(e.inputs[0].name, e.inputs[0])
            args, _ = e.var_args()
            if e.op.name == "grad_sync":
                if src.name not in inputs:
                    raise AutospError(f"autosp: grad_sync on {src}, which is not a graph input; "
                                      "it must sit right after a parameter")
                sync[src.name] = tuple(args[1])
            else:
                scale[e.outputs[0].name] = float(args[1])
            sub[e.outputs[0].name] = src
            continue
        if any(x.name in sub for x in e.inputs):
            e = e.replace(inputs=tuple(sub.get(x.name, x) for x in e.inputs))
        eqns.append(e)
    outputs = tuple(sub.get(o.name, o) if isinstance(o, Var) else o for o in local.outputs)
    scales = tuple(scale.get(o.name, 1.0) if isinstance(o, Var) else 1.0 for o in local.outputs)
    syncs = tuple((i, sync[v.name]) for i, v in enumerate(local.inputs) if v.name in sync)
    return StepBoundary(local.replace(eqns=tuple(eqns), outputs=outputs, name="split_boundary"), syncs, scales)


@dataclass(frozen=True, slots=True)
class Joint:
    graph: Graph                      # primals, tangents -> forward outputs, gradients
    n_primals: int
    n_fwd_outputs: int
    boundary: int                     # graph.eqns[:boundary] is the forward
    diff_inputs: tuple[int, ...]      # primal positions with a gradient output, in output order
    diff_outputs: tuple[int, ...]     # forward outputs with a tangent input, in input order

    @property
    def forward_eqns(self):
        return self.graph.eqns[:self.boundary]

    @property
    def backward_eqns(self):
        return self.graph.eqns[self.boundary:]


def differentiable_inputs(graph: Graph) -> tuple[int, ...]:
    return tuple(i for i, v in enumerate(graph.inputs) if v.role is Role.PARAM)


def on_device(graph: Graph, old: str, new: str) -> Graph:
    """The same program with every value and every device argument on `old` moved to `new`.

    A graph traced on the meta device (planning without memory) is differentiated as a CPU
    graph: on meta, SDPA has no fused kernel and decomposes into its s x s math path, so the
    backward would not be the one any real device runs.
    """
    from torch.utils import _pytree as pytree

    def move_var(v: Var) -> Var:
        return dataclasses.replace(v, device=new) if v.device == old else v

    def move_arg(a):
        if isinstance(a, torch.device) and a.type == old:
            return torch.device(new)
        if isinstance(a, str) and a == old:
            return new
        return a

    sub: dict[str, Var] = {v.name: move_var(v) for v in graph.inputs}
    sub.update({v.name: move_var(v) for v, _ in graph.consts})
    eqns = []
    for e in graph.eqns:
        outs = tuple(move_var(o) for o in e.outputs)
        sub.update({o.name: n for o, n in zip(e.outputs, outs)})
        args = pytree.tree_map(move_arg, e.args)
        kwargs = tuple((k, pytree.tree_map(move_arg, v)) for k, v in e.kwargs)
        eqns.append(e.replace(inputs=tuple(sub[x.name] for x in e.inputs), outputs=outs, args=args, kwargs=kwargs))
    outputs = tuple(sub[o.name] if isinstance(o, Var) else o for o in graph.outputs)
    consts = tuple((sub[v.name], t) for v, t in graph.consts)
    return graph.replace(inputs=tuple(sub[v.name] for v in graph.inputs), eqns=tuple(eqns), outputs=outputs,
                         consts=consts)


def differentiate(fwd: Graph, diff_inputs: tuple[int, ...] | None = None, *, whole: bool = False) -> Joint:
    """The joint forward + backward graph of `fwd` w.r.t. its inputs at `diff_inputs`: one segment at a time
    where the forward can be cut (passes/segments.py: the same joint, each distinct layer traced once), else
    (or `whole`) in one trace."""
    if any(v.device == "meta" for v in fwd.inputs) or any(v.device == "meta" for v, _ in fwd.consts):
        fwd = on_device(fwd, "meta", "cpu")
    diff = differentiable_inputs(fwd) if diff_inputs is None else tuple(diff_inputs)
    n_in, n_const = len(fwd.inputs), len(fwd.consts)
    const_names = [f"_const{i}" for i in range(n_const)]
    out_vars = [o for o in fwd.outputs]
    # which outputs carry a gradient: floating outputs that depend on a differentiated input
    deps = _depends_on(fwd, {fwd.inputs[i].name for i in diff})
    diff_out = tuple(j for j, o in enumerate(out_vars)
                     if isinstance(o, Var) and o.dtype is not None and o.dtype.is_floating_point and o.name in deps)
    if not diff_out:
        raise AutospError("autosp: no output of the function depends on a parameter, so there is nothing to "
                          "differentiate. Fix: return the loss computed from the parameters.")
    if not whole:
        from autosp.passes.segments import differentiate_segments
        joint = differentiate_segments(fwd, diff, diff_out)
        if joint is not None:
            return joint
    gm = lower(fwd)
    found: list[tuple[int, ...]] = []
    marks: list[int | None] = []

    def joint(*flat):
        primals = list(flat[:n_in])
        consts = flat[n_in:n_in + n_const]
        tangents = flat[n_in + n_const:]
        for name, t in zip(const_names, consts):
            setattr(gm, name, t)
        for i in diff:
            primals[i] = primals[i].detach().requires_grad_(True)
        with torch.enable_grad():
            outs = gm(*primals)
            mode = get_proxy_mode()
            marks.append(len(mode.tracer.graph.nodes) if mode is not None else None)
            live = [j for j in diff_out if outs[j].requires_grad]
            grads = torch.autograd.grad([outs[j] for j in live], [primals[i] for i in diff],
                                        [tangents[diff_out.index(j)] for j in live], allow_unused=True)
        found.append(tuple(live))
        grads = [torch.zeros_like(primals[i]) if g is None else g for i, g in zip(diff, grads)]
        return (*outs, *grads)

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        prim = [torch.empty(v.shape, dtype=v.dtype, device=v.device) for v in fwd.inputs]
        tans = [torch.empty(out_vars[j].shape, dtype=out_vars[j].dtype, device=out_vars[j].device)
                for j in diff_out]
    with mode:
        # constants enter as fakes on their graph device (a meta buffer planned as a CPU one)
        consts = [torch.empty(v.shape, dtype=v.dtype, device=v.device) if t.device.type == "meta"
                  else mode.from_tensor(t) for v, t in fwd.consts]
    saved_attrs = {name: getattr(gm, name) for name in const_names}
    from autosp.trace import lift, uncompiled
    try:
        with uncompiled():
            jgm = make_fx(joint, tracing_mode="fake")(*prim, *consts, *tans)
    finally:
        for name, t in saved_attrs.items():
            setattr(gm, name, t)
    live = found[-1]
    if live != diff_out:
        raise AutospError(f"autosp: outputs {sorted(set(diff_out) - set(live))} look differentiable but do not "
                          "require grad when run (detached inside the function?). Fix: return them detached "
                          "explicitly or not at all.")
    ins = ([Var(v.name, v.dtype, v.shape, v.device, role=v.role) for v in fwd.inputs]
           + [Var(f"{v.name}", v.dtype, v.shape, v.device, role=Role.CONST) for v, _ in fwd.consts]
           + [Var(f"tangent{k}", out_vars[j].dtype, out_vars[j].shape, out_vars[j].device, role=Role.TANGENT)
              for k, j in enumerate(diff_out)])
    lifted = lift(jgm, ins)
    # the constants went in as inputs (so that the trace saw fakes); they are constants again
    const_vars = ins[n_in:n_in + n_const]
    graph = lifted.replace(inputs=tuple(ins[:n_in] + ins[n_in + n_const:]),
                           consts=tuple(zip(const_vars, (t for _, t in fwd.consts))) + lifted.consts,
                           in_spec=fwd.in_spec, out_spec=None, static_args=fwd.static_args, name="differentiate")
    boundary = _forward_eqn_count(jgm, marks[-1]) if marks[-1] is not None else None
    if boundary is None:
        tangents = {v.name for v in graph.inputs if v.role is Role.TANGENT}
        boundary = next((k for k, e in enumerate(graph.eqns) if _touches(e, tangents)), len(graph.eqns))
    return Joint(graph, n_in, len(fwd.outputs), boundary, diff, diff_out)


def _depends_on(graph: Graph, roots: set[str]) -> set[str]:
    deps = set(roots)
    for e in graph.eqns:
        if any(x.name in deps for x in e.inputs):
            deps.update(o.name for o in e.outputs)
    return deps


def _forward_eqn_count(gm: torch.fx.GraphModule, n_nodes: int) -> int:
    """How many IR equations `lift` makes of the first `n_nodes` fx nodes (those traced before
    autograd.grad ran): every call_function except getitems of multi-output nodes."""
    count = 0
    for k, node in enumerate(gm.graph.nodes):
        if k >= n_nodes:
            break
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and isinstance(node.args[0].meta.get("val"), (tuple, list)):
            continue
        count += 1
    return count


def _touches(e, tangents: set[str]) -> bool:
    """Whether an equation belongs to the backward: it reads a tangent (directly or not)."""
    return any(x.name in tangents for x in e.inputs)

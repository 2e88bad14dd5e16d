"""Differentiate a forward one segment at a time, each distinct segment traced once.

    joint = differentiate_segments(fwd, diff, diff_out)    # None: differentiate the whole at once

A model's step is the same layer many times over (32 for an 8B Llama, each with its MLP in 8 tiles),
and make_fx costs the same for every copy: 16 s for the 8B step's 19,927 joint equations. Here the
forward is cut where the backward cannot tell it was cut, each segment is differentiated on its own
(make_fx over the segment and torch.autograd.grad from the gradients of what it hands on), a segment
equal to one already traced (the same equations on the same shapes, up to names) is not traced again,
and the pieces are joined in the order torch's autograd engine runs the whole: the forward segments in
order, then their backwards last to first.

Why that order is the engine's. The engine runs the ready node of the highest sequence number (the
latest made in the forward). The step's differentiated outputs are made after the last cut, and no node
of a segment depends on an earlier segment's backward, so while a later segment has nodes to run one of
them is ready, and it outranks every earlier segment's node: the segments' backwards run last to first,
each as it runs alone once all its outputs' gradients are in (the gradients from later segments arrive
as tangents, with the strides they have in the whole). A value read in several later segments (a tied
embedding's weight) has its gradient summed as each lands: each segment that reads it but the last also
returns it, as it came, with the later segments' sum as that output's tangent, so its own trace makes
the sum where the engine makes it. Cuts are kept out of the values read within half the forward (a
layer's), so that the segments fall at the same place in every layer.

Each segment is traced on inputs with the strides the whole gives them (a reshape is a view or a copy by
them), and its backward from tangents with the strides its gradients have there. The result is equal,
equation for equation and name for name, to differentiating the whole (tests/test_segments.py holds it
so across the zoo); where a segment's trace would not show what the whole does (a constant its trace
makes, no cut), where the segments hardly repeat (a 2-layer model: a
trace's setup per segment costs more than it saves), or where a segment fails to trace, this returns None
and the caller differentiates the whole (which raises what there is to raise).
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from autosp.ir.core import Eqn, Graph, Role, Var
from autosp.ir.lower import lower

MIN_EQNS = 8        # a segment's least equations: fewer cost a trace's setup each for little
DISTINCT = 0.6      # where the distinct segments hold more of the forward than this, it is differentiated whole


class _Unsplittable(Exception):
    """A segment's trace would differ from the whole's: differentiate the whole."""


def cuts(fwd: Graph, diff: tuple[int, ...]) -> list[int]:
    """The positions k (the cut before fwd.eqns[k]) the forward may be cut at, at least MIN_EQNS apart."""
    eqns = fwd.eqns
    n = len(eqns)
    grad = {fwd.inputs[i].name for i in diff}          # floating values that depend on a differentiated input
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    made: dict[str, int] = {}
    for k, e in enumerate(eqns):
        carries = False
        for x in e.inputs:
            if x.name in grad:
                carries = True
                first.setdefault(x.name, k)
                last[x.name] = k
        for o in e.outputs:
            made[o.name] = k
            if carries and o.dtype is not None and o.dtype.is_floating_point:
                grad.add(o.name)
    blocked = [0] * (n + 2)                             # a difference array over cut positions
    for name, lo in first.items():
        # a value read across half the forward (a tied embedding's weight, each MoE layer's router logits for the
        # loss) is handed through the segments that read it (_Segment.through); the others keep a layer whole
        if lo < last[name] <= lo + n // 2:
            blocked[lo + 1] += 1
            blocked[last[name] + 1] -= 1
    for o in fwd.outputs:                               # the differentiated outputs: in the last segment
        if isinstance(o, Var) and o.name in grad:
            if o.name not in made:
                return []
            blocked[made[o.name] + 1] += 1
            blocked[n + 1] -= 1
    out, run, prev = [], 0, 0
    for k in range(1, n):
        run += blocked[k]
        if run == 0 and k - prev >= MIN_EQNS and n - k >= MIN_EQNS:
            out.append(k)
            prev = k
    return out


class _Segment:
    """eqns[a:b] of the forward: what it reads from before it (inputs, constants) and hands on (outputs)."""

    def __init__(self, fwd: Graph, a: int, b: int, last_read: dict[str, int], outputs: set[str],
                 const_names: set[str]):
        self.a, self.b = a, b
        eqns = fwd.eqns[a:b]
        made: set[str] = set()
        ins: dict[str, Var] = {}
        consts: dict[str, Var] = {}
        for e in eqns:
            for x in e.inputs:
                if x.name not in made:
                    (consts if x.name in const_names else ins).setdefault(x.name, x)
            made.update(o.name for o in e.outputs)
        self.inputs = list(ins.values())
        self.consts = list(consts.values())
        self.outputs = [o for e in eqns for o in e.outputs
                        if o.dtype is not None and (last_read.get(o.name, -1) >= b or o.name in outputs)]
        # inputs a later segment reads too, returned as they came: their tangent is the later segments' gradient, so
        # that this segment's trace adds its own to it where the engine adds it in the whole (`add(later, this)`)
        self.through = [v for v in self.inputs if v.dtype is not None and v.dtype.is_floating_point
                        and last_read.get(v.name, -1) >= b]
        self.all_outputs = self.outputs + self.through
        self.eqns = eqns

    def structure(self, const_ids: dict[str, int]):
        """The segment up to names: the same key for every copy of a layer (None: unhashable arguments)."""
        if hasattr(self, "_key"):
            return self._key
        local: dict[str, tuple] = {v.name: ("i", i) for i, v in enumerate(self.inputs)}
        local.update({v.name: ("c", const_ids[v.name]) for v in self.consts})
        body = []
        for k, e in enumerate(self.eqns):
            body.append((e.op.target, tuple(local[x.name] for x in e.inputs), e.args, e.kwargs, e.multi,
                         tuple((o.dtype, o.shape, o.device) for o in e.outputs)))
            for j, o in enumerate(e.outputs):
                local[o.name] = ("e", k, j)
        key = (tuple(body), tuple((v.dtype, v.shape, v.device) for v in self.inputs),
               tuple(local[o.name] for o in self.all_outputs))
        try:
            hash(key)
        except TypeError:
            key = None
        self._key = key
        return key


class _Template:
    """A segment differentiated on its own, its values named locally: inputs i<k>, constants k<k>, tangents
    t<j> (the gradient of output j), the rest as lift numbers them."""

    def __init__(self, eqns, n_detach, n_forward, outs, requires, out_strides, grads, strides, tangents):
        self.eqns = eqns                # the detaches of the inputs it differentiates, forward, backward
        self.n_detach, self.n_forward = n_detach, n_forward
        self.outs = outs                # the segment's outputs, as the trace names them
        self.requires = requires        # each output requires grad
        self.out_strides = out_strides  # each output's strides
        self.grads = grads              # input k -> its gradient's Var (None: none reaches it)
        self.strides = strides          # input k -> that gradient's strides
        self.tangents = tangents        # ((output j, strides), ...) it was traced with


def _contiguous(shape) -> tuple[int, ...]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= max(d, 1)
    return tuple(reversed(out))


def _trace(seg: _Segment, const_values, requires_in: tuple[bool, ...], strides_in, tangents, mode) -> _Template:
    """make_fx of the segment's forward on inputs of `strides_in` (as the whole makes them: a view's, a
    permute's) and of torch.autograd.grad from `tangents` ((output j, strides); None: every output that
    requires grad, contiguous) to its inputs that require grad."""
    from autosp.trace import lift, uncompiled
    outputs = seg.all_outputs
    sub = Graph(tuple(seg.inputs), tuple(seg.eqns), tuple(outputs),
                consts=tuple(zip(seg.consts, const_values)))
    gm = lower(sub)
    n_in, n_c = len(seg.inputs), len(seg.consts)
    wrt = [k for k, r in enumerate(requires_in) if r]
    floating = [j for j, o in enumerate(outputs) if o.dtype.is_floating_point]
    offered = tuple((j, _contiguous(outputs[j].shape)) for j in floating) if tangents is None else tangents
    seen: dict = {}

    def joint(*flat):
        ins = list(flat[:n_in])
        for i, t in enumerate(flat[n_in:n_in + n_c]):
            setattr(gm, f"_const{i}", t)
        tans = flat[n_in + n_c:]
        for k in wrt:
            ins[k] = ins[k].detach().requires_grad_(True)
        with torch.enable_grad():
            outs = gm(*ins)
            seen["mark"] = len(get_proxy_mode().tracer.graph.nodes)
            req = tuple(isinstance(o, torch.Tensor) and o.requires_grad for o in outs)
            seen["out_strides"] = tuple(tuple(o.stride()) if isinstance(o, torch.Tensor) else None for o in outs)
            use = [(j, t) for (j, _), t in zip(offered, tans) if tangents is not None or req[j]]
            if any(not req[j] for j, _ in use):
                raise _Unsplittable("a gradient reaches an output that does not require grad")
            grads = [None] * len(wrt)
            if use and wrt:
                grads = list(torch.autograd.grad([outs[j] for j, _ in use], [ins[k] for k in wrt],
                                                 [t for _, t in use], allow_unused=True))
        seen["req"], seen["used"] = req, tuple(j for j, _ in use)
        seen["grads"] = [g is not None for g in grads]
        seen["strides"] = [tuple(g.stride()) if g is not None else None for g in grads]
        return (*outs, *(g for g in grads if g is not None))

    with mode:
        args = [torch.empty_strided(v.shape, st, dtype=v.dtype, device=v.device)
                for v, st in zip(seg.inputs, strides_in)]
        # constants enter as fakes on their graph device (a meta buffer planned as a CPU one), as differentiate's
        args += [torch.empty(v.shape, dtype=v.dtype, device=v.device) if t.device.type == "meta"
                 else mode.from_tensor(t) for v, t in zip(seg.consts, const_values)]
        args += [torch.empty_strided(outputs[j].shape, st, dtype=outputs[j].dtype, device=outputs[j].device)
                 for j, st in offered]
    names = ([Var(f"i{k}", v.dtype, v.shape, v.device) for k, v in enumerate(seg.inputs)]
             + [Var(f"k{k}", v.dtype, v.shape, v.device, role=Role.CONST) for k, v in enumerate(seg.consts)]
             + [Var(f"t{j}", outputs[j].dtype, outputs[j].shape, outputs[j].device,
                    role=Role.TANGENT) for j, _ in offered])
    with uncompiled():
        jgm = make_fx(joint, tracing_mode="fake")(*args)
    lifted = lift(jgm, names)
    if lifted.consts:
        raise _Unsplittable("the segment's trace made a constant")
    from autosp.passes.autodiff import _forward_eqn_count
    eqns = lifted.eqns
    for k, i in enumerate(wrt):
        e = eqns[k]
        if e.op.name != "detach" or e.inputs[0].name != f"i{i}":
            raise _Unsplittable("the trace does not begin with its inputs' detaches")
    n_fwd = _forward_eqn_count(jgm, seen["mark"]) - len(wrt)
    n_out = len(outputs)
    outs = lifted.outputs[:n_out]
    grad_vars = iter(lifted.outputs[n_out:])
    grads = [None] * n_in
    strides = [None] * n_in
    for k, i in enumerate(wrt):
        if seen["grads"][k]:
            grads[i] = next(grad_vars)
            strides[i] = seen["strides"][k]
    used = tuple((j, st) for j, st in offered if j in seen["used"])
    return _Template(eqns, len(wrt), n_fwd, outs, seen["req"], seen["out_strides"], grads, strides, used)


def differentiate_segments(fwd: Graph, diff: tuple[int, ...], diff_out: tuple[int, ...]):
    """The Joint of `fwd` (already on a real device) as autodiff.differentiate makes it, or None."""
    at = cuts(fwd, diff)
    if not at:
        return None
    try:
        return _joined(fwd, diff, diff_out, [0, *at, len(fwd.eqns)])
    except Exception:           # noqa: BLE001 - _Unsplittable, or a segment's trace failing: the whole decides
        return None


def _joined(fwd: Graph, diff, diff_out, bounds):
    from autosp.ir.ops import op_for
    from autosp.passes.autodiff import Joint
    last_read: dict[str, int] = {}
    for k, e in enumerate(fwd.eqns):
        for x in e.inputs:
            last_read[x.name] = k
    out_names = {o.name for o in fwd.outputs if isinstance(o, Var)}
    const_names = {v.name for v, _ in fwd.consts}
    const_ids = {v.name: id(t) for v, t in fwd.consts}
    const_of = {v.name: t for v, t in fwd.consts}
    segs = [_Segment(fwd, a, b, last_read, out_names, const_names) for a, b in zip(bounds, bounds[1:])]
    distinct: dict = {}
    for s, seg in enumerate(segs):
        distinct.setdefault(seg.structure(const_ids) or s, len(seg.eqns))
    if sum(distinct.values()) > DISTINCT * len(fwd.eqns):     # little repeats: one trace costs less than many
        raise _Unsplittable("the segments hardly repeat")
    params = {fwd.inputs[i].name for i in diff}
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    made: dict = {}

    requires = dict.fromkeys(params, True)
    strides = {v.name: _contiguous(v.shape) for v in fwd.inputs}

    def template(s: int, seg: _Segment, tangents):
        flags = tuple(requires.get(v.name, False) for v in seg.inputs)
        st = tuple(strides[v.name] for v in seg.inputs)
        key = (seg.structure(const_ids) or ("segment", s), flags, st, tangents)
        hit = made.get(key)
        if hit is None:
            hit = made[key] = _trace(seg, [const_of[v.name] for v in seg.consts], flags, st, tangents, mode)
        return hit

    # forward: which values require grad and their strides, segment by segment, each traced with every such
    # output's tangent
    temps = []
    for s, seg in enumerate(segs):
        t = template(s, seg, None)
        requires.update((o.name, r) for o, r in zip(seg.outputs, t.requires))
        strides.update((o.name, st) for o, st in zip(seg.outputs, t.out_strides))
        temps.append(t)
    # backward, last to first: the tangents each segment gets; traced again where they differ from the guess
    grad_strides: dict[str, tuple] = {}         # value -> the strides of its gradient from the later segments
    diff_names = {fwd.outputs[j].name: k for k, j in enumerate(diff_out)}
    for s in range(len(segs) - 1, -1, -1):
        seg, t = segs[s], temps[s]
        got = []
        for j, o in enumerate(seg.all_outputs):
            if o.name in diff_names:
                got.append((j, _contiguous(o.shape)))
            elif o.name in grad_strides:
                got.append((j, grad_strides[o.name]))
        got = tuple(got)
        if got != t.tangents:
            t = temps[s] = template(s, seg, got)
        summed = {seg.all_outputs[j].name for j, _ in t.tangents}     # the later segments' gradient in its own
        for k, v in enumerate(seg.inputs):
            if t.grads[k] is not None:
                if v.name in grad_strides and v.name not in summed:
                    raise _Unsplittable(f"{v.name}'s gradient from a later segment is not summed here")
                grad_strides[v.name] = t.strides[k]

    # join: the parameters' detaches, the forwards in order, the backwards last to first, numbered as lift numbers
    counter = iter(range(1 << 62))
    ins = [Var(v.name, v.dtype, v.shape, v.device, role=v.role) for v in fwd.inputs]
    cvars = [Var(v.name, v.dtype, v.shape, v.device, role=Role.CONST) for v, _ in fwd.consts]
    tangents = [Var(f"tangent{k}", fwd.outputs[j].dtype, fwd.outputs[j].shape, fwd.outputs[j].device,
                    role=Role.TANGENT) for k, j in enumerate(diff_out)]
    value: dict[str, Var] = {v.name: v for v in ins + cvars}       # the forward's names -> the joint's
    eqns: list[Eqn] = []

    def new(o: Var) -> Var:
        return Var(str(next(counter)), o.dtype, o.shape, o.device)

    detached: dict[str, Var] = {}
    detach = op_for(torch.ops.aten.detach.default)
    for i in diff:
        v = ins[i]
        detached[v.name] = out = new(v)
        eqns.append(Eqn.make(detach, (v,), {}, (out,)))
    envs = []
    for seg, t in zip(segs, temps):
        env = {f"i{k}": value[v.name] for k, v in enumerate(seg.inputs)}
        env.update({f"k{k}": value[v.name] for k, v in enumerate(seg.consts)})
        for e in t.eqns[:t.n_detach]:                               # its detaches: the whole's own values
            name = seg.inputs[int(e.inputs[0].name[1:])].name
            env[e.outputs[0].name] = detached.get(name, value[name])
        _instantiate(t.eqns[t.n_detach:t.n_detach + t.n_forward], env, new, eqns)
        for o, to in zip(seg.outputs, t.outs):
            value[o.name] = env[to.name]
        envs.append(env)
    boundary = len(eqns)
    grads: dict[str, Var] = {}
    for s in range(len(segs) - 1, -1, -1):
        seg, t, env = segs[s], temps[s], envs[s]
        for j, _ in t.tangents:
            name = seg.all_outputs[j].name
            env[f"t{j}"] = tangents[diff_names[name]] if name in diff_names else grads[name]
        _instantiate(t.eqns[t.n_detach + t.n_forward:], env, new, eqns)
        for k, v in enumerate(seg.inputs):
            if t.grads[k] is not None:
                grads[v.name] = env[t.grads[k].name]
    zeros = op_for(torch.ops.aten.zeros_like.default)
    for i in diff:                                  # a parameter no gradient reaches: zeros, as differentiate's
        v = ins[i]
        if v.name not in grads:
            grads[v.name] = new(v)
            eqns.append(Eqn.make(zeros, (detached[v.name],), {"pin_memory": False}, (grads[v.name],)))
    outputs = tuple(value[o.name] if isinstance(o, Var) else o for o in fwd.outputs)
    outputs += tuple(grads[fwd.inputs[i].name] for i in diff)
    graph = Graph(tuple(ins + tangents), tuple(eqns), outputs, consts=tuple(zip(cvars, (t for _, t in fwd.consts))),
                  in_spec=fwd.in_spec, static_args=fwd.static_args, name="differentiate")
    return Joint(graph, len(fwd.inputs), len(fwd.outputs), boundary, tuple(diff), tuple(diff_out))


def _instantiate(template_eqns, env: dict[str, Var], new, out: list[Eqn]) -> None:
    for e in template_eqns:
        outs = tuple(new(o) for o in e.outputs)
        for o, n in zip(e.outputs, outs):
            env[o.name] = n
        out.append(e.replace(inputs=tuple(env[x.name] for x in e.inputs), outputs=outs))

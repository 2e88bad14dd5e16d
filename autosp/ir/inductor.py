"""A per-rank program through inductor (`compile=True`): fused C++/OpenMP kernels on CPU, Triton on GPU.

    run = Compiled(graph)                  # a forward or backward program of the step (autosp.remat)
    run = Compiled(graph, cuts=[40, 97])   # in segments: equations [0, 40), [40, 97), [97, end), each compiled
    outs = run(args)                       # boxed: `args` (a list) is emptied, each input freed after its last use

A program is lowered as always (lower.py: one fx node per equation, autosp's custom ops as they are), traced
again on fake tensors with inductor's decompositions (its lowering wants core ATen), and compiled by
`compile_fx_inner` at its first call, with the tensors that call gets: their sizes and strides specialise the
code, as they do a torch.compile'd function. autosp's custom ops (collectives, attention kernels, ring,
offload) stay calls into their own kernels, and they order the program as they did.

The remat plan survives compilation. A forward and its backward are separate programs, compiled separately, so
no recomputation meets its original in one graph for CSE to merge them. And a program is compiled in segments
(autosp.remat.runtime.memory_cuts): within one graph inductor fuses kernels wherever it likes, and a fused group
holds its members' inputs and outputs at once (two fused multiplies of an MLP's backward held an input eager frees:
+8.8 % at budget 0.5; a recomputation fused with a kernel of an earlier layer runs that much earlier: +6.8 % at the
least budget of a 4-layer Llama). A segment ends before the equation whose values, all made at once with none yet
freed, would take the segment above the plan's peak; values cross a cut as the plan said they would. Two of
inductor's own ways held memory no plan counts, both at the loss, where a step peaks: its decomposition of
nll_loss_backward scatters into one logits-sized buffer and scales it into another (`_nll_loss_backward` is one
expression instead, eager's values to the bit), and its (log-)softmax keeps each row's maximum and sum in buffers
(those run as eager runs them, each in a segment of its own: `_EAGER`). The compiled step then measures what eager
does: its plan to the loss's seed (+8 B, outside the program), at budgets 1.0, 0.5 and the least (it was +1,172 B,
+0.08 to +0.16 %, over the budget where the plan was close to it).

Every segment is compiled before any runs, for what its inputs will be (the strides of the segment graphs' outputs,
which compiled code keeps), and each rank of a host starts from its own share of the program: the ranks' programs
differ (each its own FX graph), but most of their C++ kernels are the same, built once into inductor's on-disk cache;
compiled in step, one rank waited on the other's build of each kernel (tests/test_inductor.py, 2 ranks on 2 cores,
inductor's cache empty: 135 s; staggered, 109 s).

Segments of the same code are compiled once: a repeated layer's segments (memory_cuts cuts the layers alike) are
the same equations on inputs of the same sizes and strides (`_key`), and each layer calls the one compiled
function (bench/compile_layers.py, the tests' Llama with 8 layers at s = 1024 and the least budget: 7 + 24 segments
of different code among 33 + 163, as with 4 layers; its first call 36 s, where each layer cut as it needed, each
segment compiled, took 97 s). `unique` says how many were compiled.

Inductor's FX graph cache (on disk) makes a second compile of the same program a cache hit: `cache` says
which it was ("hit", "miss", "mixed" over segments), `seconds` how long it took. Its key includes a digest of
autosp's sources: the cache keys a custom op by its name only, and compiled code asserts the strides its fake
reported, so code compiled against other fakes must not be reused.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch

from autosp.ir.core import Graph, Var
from autosp.ir.lower import lower


def _cache_hits() -> int:
    from torch._dynamo.utils import counters
    return int(counters["inductor"].get("fxgraph_cache_hit", 0))


def _cache_key_pass():
    """A post-grad pass that does nothing and keys the cache on autosp's sources (a user's own pass is kept)."""
    import torch._inductor.config as config
    if config.post_grad_custom_post_pass is not None:
        return config.post_grad_custom_post_pass
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Keyed(CustomGraphPass):
        def __call__(self, graph) -> None:
            return None

        def uuid(self):
            from autosp.sources import digest
            return "autosp-" + digest()
    return _Keyed()


def _nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    """aten.nll_loss_backward as one elementwise expression over the input's shape: -(the output's gradient, over
    the total weight where averaged) at each row's target class, weighted, 0 elsewhere and on ignored rows. Inductor's
    own decomposition scatters into a zero-filled buffer and scales it into a second one: at the loss's backward,
    logits-sized memory that eager's kernel (one zero-filled output) does not hold and no plan counts (the compiled
    step +0.08 % over its plan, the tests' Llama). Values as eager's: the same operations in the same order."""
    dim = 1 if self.dim() >= 2 else 0
    t = target.unsqueeze(dim)
    kept = t != ignore_index
    classes = torch.arange(self.shape[dim], device=self.device).view([-1] + [1] * (self.dim() - 1 - dim))
    if reduction == 0:                               # none: one gradient per row
        grad = -(grad_output.unsqueeze(dim) if self.dim() >= 2 else grad_output)
    elif reduction == 1:                             # mean
        grad = -(grad_output / total_weight)
    else:                                            # sum
        grad = -grad_output
    if weight is not None:
        grad = weight[torch.where(kept, t, 0)] * grad
    return torch.where((classes == t) & kept, grad, 0).to(self.dtype)


# Ops that run as eager runs them, each a segment of its own: inductor's lowering of a (log-)softmax keeps each row's
# maximum and sum in buffers (8 B a row forward, 4 B backward), which eager's kernel keeps in registers and no plan
# counts; at the loss's backward, where a step peaks, they took the compiled step over its plan (+512 B of the tests'
# 1.5 MB, over the budget where the plan is close to it; a router's softmax over 8 experts: a quarter of its output).
# Their inputs and outputs are values of the program either way: nothing is fused across them but a pointwise op.
_aten = torch.ops.aten
_EAGER = frozenset({_aten._log_softmax.default, _aten.log_softmax.int, _aten._log_softmax_backward_data.default,
                    _aten._softmax.default, _aten.softmax.int, _aten._softmax_backward_data.default})


def eager_cuts(graph: Graph) -> list[int]:
    """Cuts before and after each equation of an op run eagerly (_EAGER)."""
    return sorted({k + d for k, e in enumerate(graph.eqns) if e.op.target in _EAGER for d in (0, 1)})


def _decompositions() -> dict:
    """Inductor's decompositions, nll_loss_backward's replaced (_nll_loss_backward)."""
    from torch._inductor.decomposition import select_decomp_table
    table = dict(select_decomp_table())
    table[torch.ops.aten.nll_loss_backward.default] = _nll_loss_backward
    return table


def _decompose(gm, args: list):
    """gm (an fx module of autosp's lowering) decomposed as inductor decomposes, for `args` (_Meta: what a tensor
    will be, or a plain value): (the decomposed module, its fake inputs, their fake mode's tracing context, the
    _Meta of its outputs, whose strides compiled code keeps). The fake mode has a shape environment and is a tracing
    context's: inductor's FX graph cache keys on them (it bypasses a graph compiled without)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    fake = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    with fake:
        fakes = [a.fake() if isinstance(a, _Meta) else a for a in args]
    context = TracingContext(fake)
    with torch.no_grad(), tracing(context), fake:
        decomposed = make_fx(gm, decomposition_table=_decompositions())(*fakes)
    outs = [_Meta.of(n.meta.get("val")) if isinstance(n, torch.fx.Node) else None
            for n in decomposed.graph.output_node().args[0]]
    return decomposed, fakes, context, outs


def _fake_outputs(gm, args: list) -> list:
    """The _Meta of what gm (not decomposed) returns for `args` (_Meta or plain values): its ops' own fakes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        outs = gm(*[a.fake() if isinstance(a, _Meta) else a for a in args])
    return [_Meta.of(o) for o in outs]


def _boxed(gm):
    """gm called as compiled code is: on a list it empties."""
    def run(args: list):
        inputs = tuple(args)
        args.clear()
        return gm(*inputs)
    return run


def _compile(decomposed, fakes: list, context):
    """A module of _decompose compiled by inductor, in its tracing context."""
    import torch._inductor.config as config
    from torch._guards import tracing
    from torch._inductor.compile_fx import compile_fx_inner
    # the program's order is the plan's: inductor moving kernels for locality or its own estimate of the peak
    # would undo it (both measured above the plan)
    with torch.no_grad(), tracing(context), config.patch(
            reorder_for_locality=False, reorder_for_peak_memory=False, post_grad_custom_post_pass=_cache_key_pass()):
        return compile_fx_inner(decomposed, fakes)


@dataclass(frozen=True)
class _Meta:
    """What a tensor a segment makes will be, before it exists: a later segment is compiled for it."""
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    offset: int = 0               # into its storage (a view's): compiled code assumes what it was compiled for

    @staticmethod
    def of(t):
        if not isinstance(t, torch.Tensor):
            return None
        return _Meta(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.storage_offset())

    def fake(self):
        """The tensor, made under the fake mode that is current (nothing is allocated)."""
        if not self.offset:
            return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride) if n)
        base = torch.empty(self.offset + span, dtype=self.dtype, device=self.device)
        return base.as_strided(self.shape, self.stride, self.offset)


def _stagger(n: int) -> list[int]:
    """The order in which this rank compiles n segments: each rank of a host from its own share of the program
    (rank r of w from segment r n / w, round to the start), so that the ranks' compiles of the same kernels, which
    inductor's on-disk cache shares, fall at different times and run side by side instead of waiting on one lock."""
    import os
    import torch.distributed as dist
    if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        r, w = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    elif dist.is_available() and dist.is_initialized():
        r, w = dist.get_rank(), dist.get_world_size()
    else:
        r, w = 0, 1
    start = r % w * n // w
    return [*range(start, n), *range(start)]


@dataclass
class _Segment:
    inputs: list[str]             # the names it reads (program inputs, earlier segments' values)
    outputs: list[str]            # the names it makes that later segments or the program's outputs read
    dead: list[str]               # of its inputs, those no later segment nor output reads: let go before it runs
    gm: object                    # its lowered fx module, compiled at the first call
    span: tuple[int, int]         # its equations' indices in the program: [start, end)
    eager: bool = False           # one equation run as eager runs it (_EAGER), not compiled
    fn: object = None


class Compiled:
    """A Graph compiled by inductor at its first (boxed) call, in segments cut before equations `cuts`."""

    def __init__(self, graph: Graph, cuts=()):
        self.graph = graph
        cuts = set(cuts) | set(eager_cuts(graph))
        self.segments = _segments(graph, sorted(c for c in cuts if 0 < c < len(graph.eqns)))
        self.seconds: float | None = None
        self.cache: str | None = None
        self.unique: int | None = None            # segments of different code (a repeated layer's are compiled once)

    def __call__(self, args: list):
        if self.seconds is None:
            return self._first(args)
        return self._run(args)

    def _first(self, args: list):
        t0, hits = time.perf_counter(), _cache_hits()
        env = self._env(args)
        # every segment compiled before any runs, for what its inputs will be: the program's inputs as they are, the
        # others as the segments that make them say (their graphs' outputs, whose strides compiled code keeps)
        metas = {name: _Meta.of(t) if isinstance(t, torch.Tensor) else t for name, t in env.items()}
        traced, outs, first, twins = {}, {}, {}, []    # first: a segment's key -> the first segment of that code
        for j, seg in enumerate(self.segments):
            ins = [metas[n] for n in seg.inputs]
            # j, or an earlier segment of the same code (an eager one is its own)
            twin = j if seg.eager else first.setdefault(_key(self.graph, seg, ins), j)
            twins.append(twin)
            if seg.eager:
                outs[j] = _fake_outputs(seg.gm, ins)
                seg.fn = _boxed(seg.gm)
            elif twin == j:
                gm, fakes, context, outs[j] = _decompose(seg.gm, ins)
                traced[j] = (gm, fakes, context)
            metas.update(zip(seg.outputs, outs[twin]))
        for j in _stagger(len(self.segments)):     # this rank's own share first: the cache has the rest when it comes
            if j in traced:
                self.segments[j].fn = _compile(*traced.pop(j))
        for seg, twin in zip(self.segments, twins):
            seg.fn = self.segments[twin].fn
        self.unique = len(first)
        for seg in self.segments:
            self._step(seg, [env[n] for n in seg.inputs], env)
        self.seconds = time.perf_counter() - t0
        hit = _cache_hits() - hits
        self.cache = "hit" if hit == self.unique else "miss" if hit == 0 else "mixed"
        return self._outputs(env)

    def _run(self, args: list):
        env = self._env(args)
        for seg in self.segments:
            self._step(seg, [env[n] for n in seg.inputs], env)
        return self._outputs(env)

    def _env(self, args: list) -> dict:
        env = dict(zip((v.name for v in self.graph.inputs), args))
        args.clear()                  # the caller holds nothing now: an input goes once no segment reads it
        return env

    @staticmethod
    def _step(seg: _Segment, seg_args: list, env: dict) -> None:
        for name in seg.dead:
            env.pop(name, None)
        outs = seg.fn(seg_args)
        env.update(zip(seg.outputs, outs))

    def _outputs(self, env: dict) -> list:
        return [env[o.name] if isinstance(o, Var) else o for o in self.graph.outputs]


def _segments(graph: Graph, cuts: list[int]) -> list[_Segment]:
    bounds = [0, *cuts, len(graph.eqns)]
    made: dict[str, int] = {v.name: -1 for v in graph.inputs}          # name -> the segment that makes it last
    spans = list(zip(bounds, bounds[1:]))
    for j, (a, b) in enumerate(spans):
        for e in graph.eqns[a:b]:
            for o in e.outputs:
                made[o.name] = j
    read_at: dict[str, int] = {}                                        # name -> the last segment that reads it
    for j, (a, b) in enumerate(spans):
        for e in graph.eqns[a:b]:
            for x in e.inputs:
                read_at[x.name] = j
    final = {o.name for o in graph.outputs if isinstance(o, Var)}
    consts = {v.name for v, _ in graph.consts}
    out = []
    for j, (a, b) in enumerate(spans):
        eqns = graph.eqns[a:b]
        inside = {o.name for e in eqns for o in e.outputs}
        seen, ins = set(), []
        for e in eqns:
            for x in e.inputs:
                if x.name not in seen and x.name not in consts and (x.name not in inside or _before(x, eqns)):
                    seen.add(x.name)
                    ins.append(x)
        outs = [o for e in eqns for o in e.outputs if o.dtype is not None and
                (o.name in final or read_at.get(o.name, -1) > j) and made.get(o.name) == j]
        outs = list({o.name: o for o in outs}.values())
        used = {x.name for e in eqns for x in e.inputs}
        sub = Graph(inputs=tuple(ins), eqns=tuple(eqns), outputs=tuple(outs),
                    consts=tuple((v, t) for v, t in graph.consts if v.name in used), name=f"{graph.name}[{a}:{b}]")
        dead = [x.name for x in ins if read_at.get(x.name, -1) <= j and x.name not in final]
        eager = b - a == 1 and eqns[0].op.target in _EAGER
        out.append(_Segment([x.name for x in ins], [o.name for o in outs], dead, lower(sub), (a, b), eager))
    return out


def _key(graph: Graph, seg: _Segment, inputs: list) -> tuple:
    """What a segment's compiled code is a function of: its equations (ops, arguments, which value each reads and
    makes), the constants it reads (by their values), and what its inputs are (_Meta: sizes, strides, offset).
    Segments of equal keys lower to the same fx graph and compile to the same code: a repeated layer's segments
    are compiled once (memory_cuts places their cuts alike)."""
    local = {name: k for k, name in enumerate(seg.inputs)}
    consts = {v.name: t for v, t in graph.consts}
    parts: list = [tuple(m if isinstance(m, _Meta) else repr(m) for m in inputs)]
    a, b = seg.span
    for e in graph.eqns[a:b]:
        ins = []
        for x in e.inputs:
            if x.name in local:
                ins.append(local[x.name])
            else:                                  # a constant: by its value
                t = consts[x.name].detach().cpu().contiguous()
                data = hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                ins.append(("const", str(t.dtype), tuple(t.shape), data))
        for o in e.outputs:
            local[o.name] = len(local)
        parts.append((e.op.name, repr(e.op.target), repr(e.args), repr(e.kwargs), e.multi, tuple(ins),
                      tuple((local[o.name], str(o.dtype), o.shape, o.device) for o in e.outputs)))
    parts.append(tuple(local[n] for n in seg.outputs))
    return tuple(parts)


def _before(x: Var, eqns) -> bool:
    """Whether `x` is read in `eqns` before an equation of them makes it (a name made again: a recomputed op's
    other outputs), so the segment takes the earlier value as an input."""
    for e in eqns:
        if any(i.name == x.name for i in e.inputs):
            return True
        if any(o.name == x.name for o in e.outputs):
            return False
    return False

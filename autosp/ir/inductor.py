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
freed, would take the segment above the plan's peak; values cross a cut as the plan said they would. What remains is
inductor's own, which the memory model does not know yet: a fused reduction keeps a few values per row (the loss: +9 B
a position, +0.1 % of the tests' peaks).

Inductor's FX graph cache (on disk) makes a second compile of the same program a cache hit: `cache` says
which it was ("hit", "miss", "mixed" over segments), `seconds` how long it took. Its key includes a digest of
autosp's sources: the cache keys a custom op by its name only, and compiled code asserts the strides its fake
reported, so code compiled against other fakes must not be reused.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from autosp.ir.core import Graph, Var
from autosp.ir.lower import lower


def _cache_hits() -> int:
    from torch._dynamo.utils import counters
    return int(counters["inductor"].get("fxgraph_cache_hit", 0))


_DIGEST: list[str] = []


def _source_digest() -> str:
    """A digest of autosp's sources: its custom ops (and their fakes, whose strides compiled code asserts) are
    keyed by name only in inductor's FX graph cache, so a compiled program must not outlive the code it calls."""
    if not _DIGEST:
        import hashlib
        import pathlib
        root = pathlib.Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + path.read_bytes())
        _DIGEST.append(h.hexdigest())
    return _DIGEST[0]


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
            return "autosp-" + _source_digest()
    return _Keyed()


def _compile(gm, args: list):
    """gm (an fx module of autosp's lowering) decomposed as inductor decomposes and compiled for `args`. The
    fake mode has a shape environment and is the tracing context's: inductor's FX graph cache keys on them (it
    bypasses a graph compiled without)."""
    import torch._inductor.config as config
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    fake = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fakes = [fake.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]
    with torch.no_grad(), tracing(TracingContext(fake)):
        with fake:
            decomposed = make_fx(gm, decomposition_table=select_decomp_table())(*fakes)
        # the program's order is the plan's: inductor moving kernels for locality or its own estimate of the peak
        # would undo it (both measured above the plan)
        with config.patch(reorder_for_locality=False, reorder_for_peak_memory=False,
                          post_grad_custom_post_pass=_cache_key_pass()):
            return compile_fx_inner(decomposed, fakes)


@dataclass
class _Segment:
    inputs: list[str]             # the names it reads (program inputs, earlier segments' values)
    outputs: list[str]            # the names it makes that later segments or the program's outputs read
    dead: list[str]               # of its inputs, those no later segment nor output reads: let go before it runs
    gm: object                    # its lowered fx module, compiled at the first call
    span: tuple[int, int]         # its equations' indices in the program: [start, end)
    fn: object = None


class Compiled:
    """A Graph compiled by inductor at its first (boxed) call, in segments cut before equations `cuts`."""

    def __init__(self, graph: Graph, cuts=()):
        self.graph = graph
        self.segments = _segments(graph, sorted(set(c for c in cuts if 0 < c < len(graph.eqns))))
        self.seconds: float | None = None
        self.cache: str | None = None

    def __call__(self, args: list):
        if self.seconds is None:
            return self._first(args)
        return self._run(args)

    def _first(self, args: list):
        t0, hits, compiled = time.perf_counter(), _cache_hits(), 0
        env = self._env(args)
        for seg in self.segments:
            seg_args = [env[n] for n in seg.inputs]
            seg.fn = _compile(seg.gm, seg_args)
            compiled += 1
            self._step(seg, seg_args, env)
        self.seconds = time.perf_counter() - t0
        hit = _cache_hits() - hits
        self.cache = "hit" if hit == compiled else "miss" if hit == 0 else "mixed"
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
        out.append(_Segment([x.name for x in ins], [o.name for o in outs], dead, lower(sub), (a, b)))
    return out


def _before(x: Var, eqns) -> bool:
    """Whether `x` is read in `eqns` before an equation of them makes it (a name made again: a recomputed op's
    other outputs), so the segment takes the earlier value as an input."""
    for e in eqns:
        if any(i.name == x.name for i in e.inputs):
            return True
        if any(o.name == x.name for o in e.outputs):
            return False
    return False

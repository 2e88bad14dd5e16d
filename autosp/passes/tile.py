"""Sequence tiling of position-wise chains (Graph -> Graph), on the per-rank graph.

A chain is a connected set of equations that are position-wise along the local sequence and make a
value wider per token than what enters them: the MLP (gate / up -> activation -> multiply -> down,
[s, h] -> [s, f] -> [s, h]), the loss head (lm head -> cross-entropy per token, [s, h] -> [s, vocab]
-> [s]) and a norm that computes in fp32 on bf16 values (named mlp.i, loss, norm.i). Tiled k ways, the
chain's sequence inputs are split along the sequence (`split_with_sizes`), the chain runs once per tile,
and its outputs (narrow again) are concatenated:

    %79: f32[1 (sp s) 64]  ->  split  ->  gate, up, silu, mul, down on [1, s/k, ...]  x k  ->  cat  ->  %84

So a wide value only ever exists one tile at a time in the forward. In the backward each tile's
wide values are saved or recomputed tile by tile (the remat ILP chooses; recomputed values are
placed right before their first reader, the tile's own backward), and the parameters' gradients
sum over the tiles by autodiff. The result is exact: every position sees the same operations, and
a sum over tiles is the same sum (cross-entropy stays per token; its sum is outside the chain).

    chains = find_chains(local)             # [Chain(name='mlp.0', ...), ..., Chain(name='loss', ...)]
    tiled = tile(local, {c.id: 8 for c in chains})

A chain whose wide value is read outside it (it would exist whole anyway), that draws random
numbers (tiles would draw them in another order), or that splits a merged (b s) dim is not found.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autosp.ir.core import Eqn, Graph, Var, map_args
from autosp.ir.ops import Tag, op_for
from autosp.passes.shard_rules import POSITIONWISE_NAMES

aten = torch.ops.aten

WIDE = 1.5              # a value is wide when its bytes per token are this many times its chain input's

# ops that act on each position alone when the sequence dim is not one they reduce or normalise: the
# sharding pass's position-wise family, less what draws random numbers or makes new storage from nothing
_POINTWISE = POSITIONWISE_NAMES - {"dropout", "native_dropout", "bernoulli", "rand_like", "randn_like", "empty_like",
                                   "lift_fresh_copy"}
_REDUCE = {"sum", "mean", "amax", "amin", "logsumexp", "var", "std", "softmax", "_softmax", "log_softmax",
           "_log_softmax", "norm"}
_LOSS = {"cross_entropy", "nll_loss"}
_SIZED = {"view", "reshape", "_unsafe_view", "expand"}        # a size list whose sequence entry scales


class _Untileable(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Chain:
    id: str                          # the first equation's first output: names the chain in tile()
    name: str                        # "loss", "mlp.0", "mlp.1", ... (in program order)
    eqns: tuple[int, ...]            # positions in the graph
    inputs: tuple[str, ...]          # sequence values split into tiles
    outputs: tuple[str, ...]         # sequence values concatenated from the tiles
    length: int                      # the local sequence length the chain runs on
    wide_bytes: int                  # its widest value, untiled (per rank)
    in_bytes: int                    # its widest sequence input (per rank)

    def k_max(self, min_tile: int = 16) -> int:
        """The most tiles worth having: a power of two that brings the widest value down to about the
        size of the chain's input (more tiles would not lower the peak: the input is live anyway), with
        tiles of at least `min_tile` positions. A chain whose output is as wide as its input (an MLP)
        holds several values of a tile's width at once in its backward, beside the input and the output's
        gradient (five, and three of half that width, at the bench model's peak): its widest value goes
        down to half the input, and to no fewer than 8 tiles. Measured (bench/RESULTS.md): the bench
        model's least peak at 14,848 tokens 64.4 MiB in 4 tiles, 60.3 in 8; the 8-GPU 8B plan 3.82M tokens
        in 4 tiles, 4.09M in 8, 4.06M in 16 (in 1.6x the planning time). A loss chain's tiles end in
        per-token losses: tiled further it measured worse (the 8-GPU 8B plan: 2.28M tokens in 128 tiles)."""
        loss = self.name == "loss"
        k = 1
        while (self.wide_bytes / k > self.in_bytes / (1 if loss else 2) or (not loss and k < 8)) \
                and 2 * k <= self.length // min_tile:
            k *= 2
        return k


def _seq_len(v: Var) -> int:
    lay = v.layout
    return v.shape[lay.dim] // (lay.outer * lay.inner)


def _per_token(v: Var) -> float:
    return v.nbytes() / max(1, _seq_len(v))


def _dims(e: Eqn):
    a = e.bind_schema()
    d = a.get("dim")
    if d is None:
        return None
    return [d] if isinstance(d, int) else list(d)


def positionwise(e: Eqn) -> bool:
    """Every tensor output and input with a sequence is aligned on it, and nothing mixes positions."""
    if e.op.has(Tag.RANDOM) or e.op.has(Tag.INPLACE) or e.multi:
        return False
    outs = [o for o in e.outputs if o.dtype is not None]
    if not outs or any(o.layout is None or not o.layout.sharded for o in outs):
        return False
    seqs = [x for x in e.inputs if x.layout is not None]
    if not seqs:
        return False
    name = e.op.name
    if name in _POINTWISE or (e.op.has(Tag.ELEMENTWISE) and name not in _REDUCE):
        return True
    if name in _REDUCE:
        dims = _dims(e)
        x = e.inputs[0]
        return dims is not None and x.layout is not None and \
            x.layout.dim not in {d % x.ndim for d in dims}
    if name in _LOSS:
        return e.bind_schema().get("reduction") == 0
    return False


def find_chains(graph: Graph) -> list[Chain]:
    """The tileable chains of a per-rank graph (see the module docstring)."""
    eqns = graph.eqns
    producer = {o.name: i for i, e in enumerate(eqns) for o in e.outputs}
    consumers: dict[str, list[int]] = {}
    for i, e in enumerate(eqns):
        for x in e.inputs:
            consumers.setdefault(x.name, []).append(i)
    returned = {o.name for o in graph.outputs if isinstance(o, Var)}
    pw = [positionwise(e) for e in eqns]

    seen: set[int] = set()
    chains = []
    for i, e in enumerate(eqns):
        if not pw[i] or i in seen:
            continue
        ins = [x for x in e.inputs if x.layout is not None and x.dtype.is_floating_point]
        if not ins:                         # an embedding widens ids into activations: not a chain
            continue
        ref = max(_per_token(x) for x in ins)
        if not any(o.dtype is not None and _per_token(o) >= WIDE * ref for o in e.outputs):
            continue
        members, ok = _grow(i, ref, eqns, pw, producer, consumers, returned)
        if ok:
            seen |= members
            chains.append(members)
    # chains that share an equation are one chain
    merged: list[set[int]] = []
    for c in chains:
        for m in [m for m in merged if m & c]:
            merged.remove(m)
            c = c | m
        merged.append(c)
    out = []
    counts: dict[str, int] = {}
    for members in sorted(merged, key=min):
        chain = _describe(sorted(members), eqns, producer, consumers, returned)
        if chain is None:
            continue
        ops = {eqns[i].op.name for i in members}
        family = "loss" if ops & _LOSS else "mlp" if "linear" in ops else "norm"
        name = family if family == "loss" else f"{family}.{counts.get(family, 0)}"
        counts[family] = counts.get(family, 0) + 1
        out.append(Chain(chain[0], name, *chain[1:]))
    return out


def _grow(seed, ref, eqns, pw, producer, consumers, returned):
    """The equations that make or read the seed's wide values (wide: >= WIDE x ref bytes per token)."""
    members = {seed}
    queue = [seed]
    ok = True
    while queue:
        i = queue.pop()
        e = eqns[i]
        for o in e.outputs:
            if o.dtype is None or _per_token(o) < WIDE * ref:
                continue
            if o.name in returned:
                ok = False
            for c in consumers.get(o.name, ()):
                if not pw[c]:
                    ok = False
                elif c not in members:
                    members.add(c)
                    queue.append(c)
        for x in e.inputs:
            p = producer.get(x.name)
            if p is None or x.layout is None or _per_token(x) < WIDE * ref or p in members:
                continue
            if not pw[p]:
                ok = False
                continue
            members.add(p)
            queue.append(p)
    return _sandwiched(members, ok, eqns, pw, producer, consumers)


def _sandwiched(members, ok, eqns, pw, producer, consumers):
    """members with the equations between them added: those that read a member's value and make one a
    member reads (a norm's mean and rsqrt, narrow, between its wide values): the chain runs as one block."""
    lo, hi = min(members), max(members)
    ahead, stack = set(), list(members)
    while stack:                                   # reached from the members, before the chain ends
        i = stack.pop()
        for o in eqns[i].outputs:
            for c in consumers.get(o.name, ()):
                if c <= hi and c not in members and c not in ahead:
                    ahead.add(c)
                    stack.append(c)
    behind, stack = set(), list(members)
    while stack:                                   # reaching the members, after the chain starts
        i = stack.pop()
        for x in eqns[i].inputs:
            p = producer.get(x.name)
            if p is not None and p >= lo and p not in members and p not in behind:
                behind.add(p)
                stack.append(p)
    between = ahead & behind
    return members | between, ok and all(pw[i] for i in between)


def _describe(members, eqns, producer, consumers, returned):
    inside = set(members)
    made = {o.name: o for i in members for o in eqns[i].outputs}
    inputs, outputs = {}, {}
    for i in members:
        for x in eqns[i].inputs:
            if x.name not in made and x.layout is not None:
                inputs[x.name] = x
    last = max(members)
    for name, o in made.items():
        outside = [c for c in consumers.get(name, ()) if c not in inside]
        if outside or name in returned:
            if any(c < last for c in outside):
                return None                      # read outside before the chain ends: no place for the block
            outputs[name] = o
    vals = list(inputs.values()) + list(outputs.values())
    if not outputs or any(v.layout is None for v in vals):
        return None
    lengths = {_seq_len(v) for v in vals}
    if len(lengths) != 1:
        return None
    wide = max(o.nbytes() for o in made.values() if o.dtype is not None)
    narrow = max(v.nbytes() for v in inputs.values())
    first = eqns[members[0]].outputs[0].name
    return (first, tuple(members), tuple(inputs), tuple(outputs), lengths.pop(), wide, narrow)


def tile_sizes(length: int, k: int) -> list[int]:
    """k tiles as even as they go (the first length % k one longer)."""
    k = max(1, min(k, length))
    return [length // k + (1 if j < length % k else 0) for j in range(k)]


def tile(graph: Graph, ks: dict[str, int], chains: list[Chain] | None = None) -> Graph:
    """The graph with each chain named in `ks` (Chain.id -> k > 1) run in k tiles along the sequence."""
    chains = [c for c in (chains if chains is not None else find_chains(graph)) if ks.get(c.id, 1) > 1]
    var = {v.name: v for v in graph.inputs}
    var.update({v.name: v for v, _ in graph.consts})
    var.update({o.name: o for e in graph.eqns for o in e.outputs})
    blocks = {}
    for c in chains:
        try:
            blocks[max(c.eqns)] = _tiled(graph, c, ks[c.id], var)
        except _Untileable:                 # a shape the tiles cannot take: the chain stays whole
            continue
    if not blocks:
        return graph
    skip = {i for c in chains if max(c.eqns) in blocks for i in c.eqns}
    out = []
    for i, e in enumerate(graph.eqns):
        if i in blocks:
            out.extend(blocks[i])
        elif i not in skip:
            out.append(e)
    return graph.replace(eqns=tuple(out), name="tile")


def _fake(mode, v: Var):
    with mode:
        return torch.empty(v.shape, dtype=v.dtype, device=v.device)


def _tiled(graph: Graph, c: Chain, k: int, var: dict) -> list[Eqn]:
    sizes = tile_sizes(c.length, k)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[str, object] = {}

    def fake(v: Var):
        if v.name not in fakes:
            fakes[v.name] = _fake(mode, v)
        return fakes[v.name]

    block: list[Eqn] = []

    def emit(target, args, name):
        """Append target(*args) (Vars inside); its output Var(s) named name (a list for several)."""
        fargs, _ = _bind_fakes(args, {}, fake)
        with mode:
            res = target(*fargs)
        many = isinstance(res, (list, tuple))
        outs = [Var(n, r.dtype, tuple(r.shape), str(r.device)) for n, r in zip(name if many else [name],
                                                                              res if many else [res])]
        for v, r in zip(outs, res if many else [res]):
            fakes[v.name] = r
        block.append(Eqn.make(op_for(target), args, {}, outs, multi=many))
        return outs if many else outs[0]

    def unmerged(v: Var) -> tuple[list[int], int]:
        """v's shape with a merged sequence dim (outer s inner) opened, and the sequence's dim in it."""
        lay, shape = v.layout, list(v.shape)
        if lay.outer == 1:
            return shape, lay.dim
        return shape[:lay.dim] + [lay.outer, c.length * lay.inner] + shape[lay.dim + 1:], lay.dim + 1

    envs = [dict() for _ in sizes]                      # per tile: old name -> tile Var
    for name in c.inputs:                               # split the sequence inputs
        x = var[name]
        lay = x.layout
        shape, d = unmerged(x)
        src = x if lay.outer == 1 else emit(aten.reshape.default, (x, shape), f"{name}.open")
        pieces = emit(aten.split_with_sizes.default, (src, [t * lay.inner for t in sizes], d),
                      [f"{name}.t{j}" + ("o" if lay.outer != 1 else "") for j in range(len(sizes))])
        for j, (t, p) in enumerate(zip(sizes, pieces)):
            if lay.outer != 1:                          # (b s) -> the tile's (b t)
                size = list(x.shape)
                size[lay.dim] = lay.outer * t * lay.inner
                p = emit(aten.reshape.default, (p, size), f"{name}.t{j}")
            envs[j][name] = p
    ran: dict[tuple[int, int], object] = {}             # (equation, tile size) -> its fake result
    for j, t in enumerate(sizes):
        env = envs[j]
        for i in c.eqns:
            e = graph.eqns[i]
            ins = [env.get(x.name, x) for x in e.inputs]
            args, kwargs = e.bind(ins)
            if e.op.name in _SIZED:
                o = e.outputs[0]
                size = list(args[1])
                size[o.layout.dim] = o.shape[o.layout.dim] // c.length * t
                args = (args[0], size) + tuple(args[2:])
            res = ran.get((i, t))
            if res is None:     # a tile of a size an earlier tile had takes its shapes (at most 2 sizes run)
                fargs, fkw = _bind_fakes(args, kwargs, fake)
                with mode:
                    res = ran[(i, t)] = e.op.target(*fargs, **fkw)
            outs = []
            for o, r in zip(e.outputs, [res]):
                want = list(o.shape)
                want[o.layout.dim] = o.shape[o.layout.dim] // c.length * t
                if tuple(r.shape) != tuple(want) or r.dtype != o.dtype:
                    raise _Untileable(f"{e.format()}: a tile gives {list(r.shape)}, not {want}")
                v = Var(f"{o.name}.t{j}", o.dtype, tuple(want), o.device)
                fakes[v.name] = r
                env[o.name] = v
                outs.append(v)
            block.append(Eqn.make(e.op, args, kwargs, outs, source=e.source))
    for name in c.outputs:                              # concatenate the outputs: the original values
        o = var[name]
        lay = o.layout
        if lay.outer == 1:
            block.append(Eqn.make(op_for(aten.cat.default), ([env[name] for env in envs], lay.dim), {}, [o]))
            continue
        shape, d = unmerged(o)
        opened = []
        for j, (t, env) in enumerate(zip(sizes, envs)):
            size = list(shape)
            size[d] = t * lay.inner
            opened.append(emit(aten.reshape.default, (env[name], size), f"{name}.t{j}o"))
        whole = emit(aten.cat.default, (opened, d), f"{name}.open")
        block.append(Eqn.make(op_for(aten.reshape.default), (whole, list(o.shape)), {}, [o]))
    return block


def _bind_fakes(args, kwargs, fake):
    conv = lambda x: fake(x) if isinstance(x, Var) else x
    return map_args(conv, args), map_args(conv, kwargs)

"""The sharding pass: a global forward graph -> the graph one rank of `sp` runs.

1. find every value's sequence dim (seqdims.py), seeded by attention or in_specs, else by the token
   ids (an integer [b, s] input that feeds an embedding);
2. mark activations: values that depend on a floating input (params, embeddings);
   activations with a sequence dim are sharded, everything else (token ids, labels,
   position ids, masks, RoPE tables) is computed replicated and sharded where it meets
   an activation - which keeps label shifts and position ids exact;
3. rewrite each equation with its rule (shard_rules.py), collectives as ordinary ops;
4. outputs: sequence-sharded outputs are gathered; scalar losses are averaged over dp.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autosp import collectives as C
from autosp.errors import ShardError
from autosp.ir.core import Graph, Role, Var
from autosp.layout import seq_dim_of_spec
from autosp.ir.ops import Tag
from autosp.passes.dce import dce
from autosp.passes.prefetch import schedule_gathers
from autosp.passes.dispatch import dispatch_rule, find_dispatch_regions
from autosp.passes.seqdims import SeqPos, attention_length, infer_seq_positions, token_id_seeds
from autosp.passes.shard_ctx import MeshInfo, ShardCtx
from autosp.passes.regions import find_regions
from autosp.passes.seqregions import find_seq_regions, seq_region_rule
from autosp.passes.shard_rules import region_rule, replicate, rule_for

aten = torch.ops.aten


_WRITES = {"slice_scatter", "select_scatter", "copy.default", "index_put", "scatter", "scatter_add", "index_add"}


def activations(graph: Graph) -> set[str]:
    """Names of values that depend on a floating-point graph input (parameters, embeddings); a fresh
    buffer (new_zeros, ...) that an activation is written into counts as one (its layout is the
    activation's), and so do the views it was written through."""
    heavy = {v.name for v in graph.inputs if v.dtype is not None and v.dtype.is_floating_point}
    producer = {o.name: e for e in graph.eqns for o in e.outputs}
    size = -1
    while size != len(heavy):                      # a base marked late makes its later views activations too
        size = len(heavy)
        for e in graph.eqns:
            if not any(x.name in heavy for x in e.inputs):
                continue
            heavy.update(o.name for o in e.outputs)
            if e.op.name in _WRITES:
                stack = [e.inputs[0]]
                while stack:                       # the base and the chain it came from, back to its creation
                    v = stack.pop()
                    if v.name in heavy:
                        continue
                    heavy.add(v.name)
                    p = producer.get(v.name)
                    if p is not None and (p.op.has(Tag.VIEW) or p.op.name in _WRITES) and p.inputs:
                        stack.append(p.inputs[0])
    return heavy


def input_free(graph: Graph) -> set[str]:
    """Values that depend on no graph input and no randomness: constants the compiler may evaluate."""
    free = {v.name for v, _ in graph.consts}
    for e in graph.eqns:
        if e.outputs and not e.op.has(Tag.RANDOM) and all(x.name in free for x in e.inputs):
            free.update(o.name for o in e.outputs)
    return free


def _replicated_is_at_hand(ctx: ShardCtx, e) -> bool:
    """No activation in or out, some input sharded, and every sharded input's replicated value known."""
    if any(x.name in ctx.heavy for x in e.inputs) or any(ctx.wants_shard(o) for o in e.outputs):
        return False
    sharded = [x for x in e.inputs if ctx.env[x.name].layout is not None]
    return bool(sharded) and all(x.name in ctx.rep for x in sharded)


def spec_seeds(graph: Graph, in_specs) -> dict[str, SeqPos | None]:
    """Var name -> SeqPos (or None: no sequence) for inputs that have a spec."""
    seeds = {}
    if in_specs is None:
        return seeds
    for v, spec in zip(graph.inputs, in_specs):
        if spec is None:
            continue
        d = seq_dim_of_spec(spec, v.shape, f"in_specs for input {v}")
        seeds[v.name] = SeqPos(d) if d is not None else None
    return seeds


@dataclass(frozen=True)
class Analysis:
    """What the sharding pass reads off a global graph before it rewrites anything."""
    length: int                      # the sequence length
    pos: dict                        # var name -> its sequence dim (seqdims.SeqPos)
    heavy: set                       # activations
    free: set                        # input-free values
    regions: list                    # attention written out (regions.AttentionRegion)
    recurrences: list                # other head-parallel regions (seqregions.SeqRegion)
    dispatch: list                   # MoE token dispatch (dispatch.DispatchRegion)

    def summary(self, graph: Graph) -> str:
        """One line per head-parallel region: what explain prints."""
        lines = [f"# head-parallel regions: {len(self.regions)} attention written out, "
                 f"{len(self.recurrences)} recurrences or scans along the sequence"]
        for r in self.recurrences:
            src = graph.eqns[min(r.eqns)].source or "<no source line>"
            lines.append(f"#   {r.describe(graph)}: {len(r.entries)} all-to-all(s) in, {len(r.exits)} out, at {src}")
        return "\n".join(lines)


def analyse(graph: Graph, mesh: MeshInfo, in_specs=None) -> Analysis:
    """The sequence length and dims, the activations, and the regions each rank runs whole."""
    seeds = spec_seeds(graph, in_specs)
    regions = find_regions(graph)
    length = attention_length(graph, [])
    ids = token_id_seeds(graph)
    known = length or max((v.shape[ids[v.name].dim] for v in graph.inputs if v.name in ids), default=0)
    if known:                       # square matmuls over blocks of a recurrence are not attention
        regions = [r for r in regions if r.q.shape[-2] == known]
    length = attention_length(graph, regions)
    if not length:
        if not any(p is not None for p in seeds.values()):
            # no attention (a pure recurrence) or attention of its own that is no region (sinks joined
            # to the scores): the token ids name the sequence, unless in_specs did
            seeds.update({n: p for n, p in token_id_seeds(graph).items() if n not in seeds})
        lengths = {v.shape[p.dim] for v in graph.inputs if (p := seeds.get(v.name)) is not None}
        if not lengths:
            ints = ", ".join(f"{v}: {v.type_str()}" for v in graph.inputs
                             if v.dtype is not None and not v.dtype.is_floating_point) or "none"
            raise ShardError(
                "autosp.shard: the function has no attention (scaled_dot_product_attention, or attention written "
                "out as matmul, softmax, matmul) and no token ids (an integer [b, s] or [s] input that feeds an "
                f"embedding) to infer the sequence dim from (integer inputs: {ints}). Fix: pass in_specs naming "
                "the sequence dim, e.g. in_specs=(None, 'b s') for (params, input_ids) or (None, 'b s d') for "
                "(params, embeddings).")
        length = max(lengths)
    blocked = {n for n, p in seeds.items() if p is None}
    pos = infer_seq_positions(graph, {n: p for n, p in seeds.items() if p is not None}, regions)
    for n in blocked:
        pos.pop(n, None)
    free = input_free(graph)
    heavy = activations(graph)
    claimed = {k for r in regions for k in r.eqns}
    return Analysis(length, pos, heavy, free, regions,
                    find_seq_regions(graph, pos, heavy, length, mesh.sp_size, claimed),
                    find_dispatch_regions(graph, pos, free))


def shard_graph(graph: Graph, mesh: MeshInfo, *, in_specs=None, keep_sharded=(), params=None) -> Graph:
    """Rewrite a global forward graph into the per-rank graph (local shapes, collectives).

    `params`: input name -> autosp.params.ParamShard for parameters split on dim 0 (FSDP2's
    layout): the per-rank graph takes the shard and gathers it (all_gather_param), whose backward
    reduce-scatters the gradient; schedule_gathers then issues each gather a layer ahead of use."""
    params = params or {}
    graph = dce(graph)              # what nothing reads (a model's unused chunked copy) needs no rule
    found = analyse(graph, mesh, in_specs)
    pos, heavy, free, length = found.pos, found.heavy, found.free, found.length
    chunk = -(-length // mesh.sp_size)
    dispatch = {k: r for r in found.dispatch for k in r.eqns}
    in_region = {k: r for r in found.regions for k in r.eqns}
    in_seq = {k: r for r in found.recurrences for k in r.eqns}
    ctx = ShardCtx(mesh=mesh, chunk=chunk, pos=pos, heavy=heavy, graph=graph,
                   input_free=free,
                   producer={o.name: e for e in graph.eqns for o in e.outputs})

    new_inputs = []
    with ctx.fake_mode:
        for v in graph.inputs:
            ps = params.get(v.name)
            if ps is not None and ps.rows:          # the shard: `chunk` rows of the master dtype
                nv = Var(v.name, ps.master, (ps.chunk,) + v.shape[1:], v.device, role=v.role)
            else:
                nv = Var(v.name, v.dtype, v.shape, v.device, role=v.role)
            ctx.fakes[v.name] = torch.empty(nv.shape, dtype=nv.dtype, device=nv.device)
            new_inputs.append(nv)
            ctx.env[v.name] = nv
    new_consts = []
    for v, t in graph.consts:
        ctx.fakes[v.name] = ctx.fake_mode.from_tensor(t)
        ctx.env[v.name] = v
        new_consts.append((v, t))
    for v in graph.inputs:
        ps = params.get(v.name)
        if ps is not None:
            if v.role is Role.PARAM and ps.sync:
                ctx.env[v.name] = ctx.emit(C.grad_sync, (ctx.env[v.name], ps.sync))
            if ps.rows:
                ctx.env[v.name] = ctx.emit(C.all_gather_param, (ctx.env[v.name], ps.rows, ps.group, ps.dtype,
                                                                ps.reduce_dtype))
            continue
        if v.role is Role.PARAM:
            ctx.env[v.name] = ctx.emit(C.grad_sync, (ctx.env[v.name], mesh.grad_groups))
        if ctx.wants_shard(v):
            ctx.rep[v.name] = ctx.env[v.name]
            ctx.env[v.name] = ctx.shard(ctx.env[v.name], v)

    for k, e in enumerate(graph.eqns):
        try:
            if k in in_seq:                          # a recurrence or scan: this rank's heads, the whole sequence
                seq_region_rule(ctx, e, in_seq[k])
                continue
            if k in in_region:
                if k == in_region[k].last:           # emitted whole, where all its inputs exist
                    region_rule(ctx, graph, in_region[k])
                continue
            if k in dispatch:                        # MoE experts on rows sorted by expert: this rank's rows
                dispatch_rule(ctx, e, dispatch[k])
                continue
            if _replicated_is_at_hand(ctx, e):
                # index work on small replicated values (positions, masks) stays replicated and exact,
                # even where an earlier consumer already moved a shard up their chain
                replicate(ctx, e, [ctx.rep.get(x.name, ctx.env[x.name]) for x in e.inputs])
                continue
            rule_for(e)(ctx, e)
        except ShardError:
            raise
        except Exception as exc:  # noqa: BLE001 - name the equation that could not be rewritten
            tail = "\n".join("    " + x.format() for x in ctx.eqns[-4:])
            raise ShardError(f"autosp.shard: rewriting `{e.format()}` at {e.source} failed: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}\n"
                             f"  last equations emitted:\n{tail}") from exc

    outputs = []
    for i, o in enumerate(graph.outputs):
        if not isinstance(o, Var):
            outputs.append(o)
            continue
        new = ctx.env[o.name]
        if new.layout is not None and i not in keep_sharded:
            new = ctx.as_replicated(o)
        if mesh.dp_group and new.ndim == 0 and new.dtype.is_floating_point:
            new = ctx.emit(C.all_reduce_sum, (new, mesh.dp_group))
            new = ctx.emit(aten.div.Scalar, (new, mesh.dp_size))
        if new.layout is None and new.dtype is not None and new.dtype.is_floating_point:
            # every rank returns the whole value: its grad seed is this rank's share (collectives.py)
            new = ctx.emit(C.grad_scale, (new, 1.0 / (mesh.sp_size * mesh.dp_size)))
        outputs.append(new)
    local = dce(graph.replace(inputs=tuple(new_inputs), eqns=tuple(ctx.eqns), outputs=tuple(outputs),
                              consts=tuple(new_consts), name="shard"))
    return schedule_gathers(local) if params else local

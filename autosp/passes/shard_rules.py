"""One sharding rule per op family: how an equation runs when its sequence is split over `sp`.

A rule reads the old (global) equation, emits new (local) equations through the
ShardCtx and binds the old outputs to new vars. The table `RULES` is keyed by the
canonical op name; `rule_for` gives the explicit default.
"""
from __future__ import annotations

import math
import os
from typing import Callable

import torch

from autosp import collectives as C
from autosp import ops as autosp_ops
from autosp.errors import ShardError
from autosp.ir.core import Eqn, Var
from autosp.ir.ops import Tag
from autosp.layout import Layout
from autosp.passes.masks import mask_function
from autosp.passes.seqdims import ELEMENTWISE_UNTAGGED
from autosp.passes.shard_ctx import ShardCtx

aten = torch.ops.aten
INT64_MAX = 9223372036854775807

Rule = Callable[[ShardCtx, Eqn], None]


def _sharded_inputs(ctx: ShardCtx, e: Eqn) -> list[Var]:
    return [ctx.env[x.name] for x in e.inputs if ctx.env[x.name].layout is not None]


def _norm(d: int, n: int) -> int:
    return d + n if d < 0 else d


def describe(ctx: ShardCtx, e: Eqn) -> str:
    ins = ", ".join(f"{x}: {ctx.env[x.name].type_str() if x.name in ctx.env else x.type_str()}" for x in e.inputs)
    return (f"op `{e.op.name}` at {e.source or '<no source line>'} with inputs ({ins}) on a mesh with "
            f"sp={ctx.mesh.sp_size}" + (f", dp={ctx.mesh.dp_size}" if ctx.mesh.dp_size > 1 else ""))


# ---------------------------------------------------------------- the generic families

def replicate(ctx: ShardCtx, e: Eqn, inputs: list[Var] | None = None) -> None:
    """Run the op on replicated (global) values; shard outputs that are activations right after."""
    new_in = inputs if inputs is not None else [ctx.as_replicated(x, e.source) for x in e.inputs]
    args, kwargs = e.bind(new_in)
    outs = ctx.emit(e.op.target, args, kwargs, source=e.source)
    outs = outs if isinstance(outs, tuple) else ((outs,) if outs is not None else ())
    for old, new in zip(e.outputs, outs):
        ctx.env[old.name] = new
        if ctx.wants_shard(old):
            ctx.rep[old.name] = new
            ctx.env[old.name] = ctx.shard(new, old, e.source)


def gather_fallback(ctx: ShardCtx, e: Eqn) -> None:
    """The documented exact fallback: all-gather the sequence, run globally, shard again."""
    replicate(ctx, e)


def positionwise(ctx: ShardCtx, e: Eqn, force: bool = False) -> None:
    """The shard passes through: inputs with a sequence go local, the op runs on the chunk.
    Without a sharded input or an activation output it runs replicated, unless `force`d."""
    if not force and not _sharded_inputs(ctx, e) and not any(ctx.wants_shard(o) for o in e.outputs):
        return replicate(ctx, e)
    target = e.op.target
    new_in = [ctx.as_sharded(x, e.source) if x.name in ctx.pos else ctx.env[x.name] for x in e.inputs]
    lengths = [v.layout.length for v in new_in if v.layout is not None]
    length = min(lengths) if lengths else None
    args, kwargs = e.bind(new_in)
    if e.op.name in ("view", "reshape", "_unsafe_view", "expand"):
        out = e.outputs[0]
        lay = ctx.layout_for(out)
        if lay is None:
            raise ShardError(f"{describe(ctx, e)}: this reshape splits the sequence dim across dims or drops it. "
                             "Fix: keep the sequence in one dim (merging it with the batch, `(b s)`, is fine).")
        args = (args[0], list(lay.local_shape(out.shape))) + tuple(args[2:])
    target = e.op.target
    if e.op.name in ("view", "_unsafe_view"):
        # the local value's strides can differ from the global trace's (an all-to-all output
        # is contiguous where SDPA's was not): reshape is the same values, copying only if needed
        target = aten.reshape.default
    layouts = [ctx.layout_for(o, length) if o.name in ctx.pos else None for o in e.outputs]
    if not e.multi and e.outputs and layouts[0] is None and lengths:
        raise ShardError(f"{describe(ctx, e)}: the output loses the sharded sequence dim and autosp has no "
                         "rule to combine the ranks' parts. Fix: reduce with sum/mean, or pass in_specs that "
                         "leave this value replicated.")
    outs = ctx.emit(target if lengths else e.op.target, args, kwargs, source=e.source, layouts=layouts)
    outs = outs if isinstance(outs, tuple) else (outs,)
    for old, new in zip(e.outputs, outs):
        if new.layout is not None and new.shape != new.layout.local_shape(old.shape):
            same = [d for d, n in enumerate(old.shape) if n == new.layout.length]
            why = (f" Its dims {same} are all {new.layout.length} long, the sequence's length: which is the "
                   f"sequence is ambiguous (another size of the model equals it). Fix: a sequence length unlike the "
                   f"model's sizes (autosp train/plan: another --seq-len), or in_specs naming the sequence dim."
                   if len(same) > 1 else " Fix: pass in_specs naming the sequence dim.")
            raise ShardError(f"{describe(ctx, e)}: local result {new.type_str()} does not match the layout "
                             f"of the global {old.type_str()}.{why}")
        ctx.env[old.name] = new


def seq_dim_arg(arg_name: str, default=None, many: bool = False) -> Rule:
    """Ops with a `dim` argument: position-wise unless that dim is the sharded sequence."""
    def rule(ctx: ShardCtx, e: Eqn) -> None:
        x = ctx.env[e.inputs[0].name]
        if x.layout is None:
            return positionwise(ctx, e)
        d = e.bind_schema().get(arg_name, default)
        dims = d if isinstance(d, (list, tuple)) else [d]
        if d is None or d == [] or d == () or x.layout.dim in {_norm(v, x.ndim) for v in dims}:
            return gather_fallback(ctx, e)
        positionwise(ctx, e)
    return rule


def tensor_split_rule(ctx: ShardCtx, e: Eqn) -> None:
    """tensor_split along the sequence at its end (Qwen3-Next and Mamba split off a remainder that is
    empty at training lengths): the whole piece is the input, the empty ones are empty; a split inside
    the sequence falls back to the gather (a head-parallel region takes it where it is one)."""
    x = ctx.env[e.inputs[0].name]
    old = e.inputs[0]
    d = _norm(e.bind_schema().get("dim", 0), old.ndim)
    if x.layout is None or x.layout.dim != d:
        return positionwise(ctx, e)
    whole = [o for o in e.outputs if o.shape == old.shape]
    if len(whole) != 1 or any(o.shape[d] != 0 for o in e.outputs if o is not whole[0]):
        return gather_fallback(ctx, e)
    for o in e.outputs:
        ctx.env[o.name] = x if o is whole[0] else ctx.emit(aten.new_zeros.default, (x, list(o.shape)),
                                                           source=e.source)


def layer_norm_rule(ctx: ShardCtx, e: Eqn) -> None:
    x = ctx.env[e.inputs[0].name]
    n = len(e.bind_schema()["normalized_shape"])
    if x.layout is not None and x.layout.dim >= x.ndim - n:
        return gather_fallback(ctx, e)
    positionwise(ctx, e)


def slice_rule(ctx: ShardCtx, e: Eqn) -> None:
    """x[:, :n] keeps the chunks (fewer valid positions); an offset needs the neighbours' data."""
    x_old = e.inputs[0]
    x = ctx.env[x_old.name]
    b = e.bind_schema()
    lay = x.layout
    if lay is None or _norm(b["dim"], x.ndim) != lay.dim:
        return positionwise(ctx, e)
    glen = x_old.shape[lay.dim]
    if e.op.name == "narrow":
        start, end, step = b["start"], b["start"] + b["length"], 1
    else:
        start, end, step = b["start"] or 0, b["end"], b["step"] or 1
        end = glen if end is None or end >= INT64_MAX else end
    start, end = _norm(start, glen), min(_norm(end, glen), glen)
    out = e.outputs[0]
    if step != 1 or start != 0 or lay.outer != 1 or lay.inner != 1 or out.name not in ctx.pos:
        # an offset, a stride, a merged dim, or what is left is no sequence (one position): exact fallback
        return gather_fallback(ctx, e)
    new_lay = Layout(lay.dim, min(lay.length, end), lay.chunk, lay.outer, lay.inner)
    ctx.env[out.name] = ctx.emit(aten.alias.default, (x,), source=e.source, layouts=[new_lay])


def cat_rule(ctx: ShardCtx, e: Eqn) -> None:
    """Empty placeholders (an empty KV cache) drop out, a cat of one value is that value (Qwen3-Next joins
    its chunked part to an empty remainder); a cat along the sequence falls back."""
    live = [t for t in e.inputs if t.numel() > 0]
    if len(live) == 1:
        x = live[0]
        new = ctx.as_sharded(x, e.source) if ctx.wants_shard(e.outputs[0]) else ctx.env[x.name]
        lay = new.layout
        ctx.env[e.outputs[0].name] = ctx.emit(aten.alias.default, (new,), source=e.source,
                                             layouts=[lay] if lay is not None else None)
        return
    return seq_dim_arg("dim", 0)(ctx, e)


def pad_rule(ctx: ShardCtx, e: Eqn) -> None:
    x = ctx.env[e.inputs[0].name]
    if x.layout is None:
        return positionwise(ctx, e)
    pads = list(e.bind_schema()["pad"])
    touched = {x.ndim - 1 - i // 2 for i, p in enumerate(pads) if p}
    if x.layout.dim in touched:
        return gather_fallback(ctx, e)
    positionwise(ctx, e)


def matmul_rule(ctx: ShardCtx, e: Eqn) -> None:
    """Sequence in the rows: position-wise. Sequence contracted: fall back."""
    vals = [ctx.env[x.name] for x in e.inputs]
    if len(vals) >= 2 and vals[1].layout is not None and vals[1].ndim >= 2 and vals[1].layout.dim >= vals[1].ndim - 2:
        return gather_fallback(ctx, e)
    if vals[0].layout is not None and vals[0].layout.dim == vals[0].ndim - 1:
        return gather_fallback(ctx, e)
    positionwise(ctx, e)


def reduce_rule(ctx: ShardCtx, e: Eqn) -> None:
    """sum/mean over the sequence: a masked local sum, one all-reduce; mean divides by the global count."""
    x_old = e.inputs[0]
    x = ctx.env[x_old.name]
    if x.layout is None:
        return positionwise(ctx, e)
    b = e.bind_schema()
    dims = b.get("dim")
    if isinstance(dims, int):                        # argmax, argmin, max.dim: one dim, not a list
        dims = [dims]
    dims = list(range(x.ndim)) if dims is None or dims == [] else [_norm(d, x.ndim) for d in dims]
    lay = x.layout
    if lay.dim not in dims:
        return positionwise(ctx, e)
    if e.op.name not in ("sum", "mean"):
        return gather_fallback(ctx, e)
    keepdim = bool(b.get("keepdim") or False)
    mask = ctx.valid_mask(x)
    if mask is not None:
        x = ctx.emit(aten.where.ScalarOther, (mask, x, 0), source=e.source)
    kw = {"dtype": b["dtype"]} if b.get("dtype") is not None else {}
    part = ctx.emit(aten.sum.dim_IntList, (x, dims, keepdim), kw, source=e.source)
    total = ctx.emit(C.all_reduce_sum, (part, ctx.mesh.sp_group), source=e.source)
    if e.op.name == "mean":
        count = 1
        for d in dims:
            count *= lay.outer * lay.length * lay.inner if d == lay.dim else x_old.shape[d]
        total = ctx.emit(aten.div.Scalar, (total, count), source=e.source)
    ctx.env[e.outputs[0].name] = total


def loss_rule(ctx: ShardCtx, e: Eqn) -> None:
    """cross_entropy / nll_loss: per-token loss locally; mean = global sum / global count of
    valid, non-ignored tokens (the count all-reduced with the sum, in one collective)."""
    inp_old, tgt_old = e.inputs[0], e.inputs[1]
    if ctx.env[inp_old.name].layout is None and not ctx.wants_shard(inp_old):
        return replicate(ctx, e)
    b = e.bind_schema()
    if b.get("weight") is not None:
        raise ShardError(f"{describe(ctx, e)}: class weights in a sharded loss are not supported yet. "
                         "Fix: compute the loss with reduction='none' and weight it yourself.")
    inp = ctx.as_sharded(inp_old, e.source)
    tgt = ctx.as_sharded(tgt_old, e.source)
    if inp.layout is None or tgt.layout is None:
        raise ShardError(f"{describe(ctx, e)}: the loss input and target do not share the sequence dim. "
                         "Fix: pass in_specs naming the sequence dim of the labels.")
    ignore = b["ignore_index"]
    args = [inp, tgt, None, 0, ignore] + ([b["label_smoothing"]] if "label_smoothing" in b else [])
    per = ctx.emit(e.op.target, tuple(args), source=e.source, layouts=[tgt.layout])
    reduction = b["reduction"]
    if reduction == 0:
        ctx.env[e.outputs[0].name] = per
        return
    valid = ctx.emit(aten.ne.Scalar, (tgt, ignore), source=e.source)
    mask = ctx.valid_mask(tgt)
    if mask is not None:
        valid = ctx.emit(aten.logical_and.default, (valid, mask), source=e.source)
    per = ctx.emit(aten.where.ScalarOther, (valid, per, 0.0), source=e.source)
    acc = torch.float32 if per.dtype in (torch.float16, torch.bfloat16) else per.dtype   # token counts
    total = ctx.emit(aten.sum.dim_IntList, (per, list(range(per.ndim))), {"dtype": acc}, source=e.source)
    cast = (lambda v: v) if acc == per.dtype else \
        (lambda v: ctx.emit(aten._to_copy.default, (v,), {"dtype": per.dtype}, source=e.source))
    if reduction == 2:
        ctx.env[e.outputs[0].name] = cast(ctx.emit(C.all_reduce_sum, (total, ctx.mesh.sp_group), source=e.source))
        return
    count = ctx.emit(aten.sum.dim_IntList, (valid, list(range(valid.ndim))), {"dtype": acc}, source=e.source)
    both = ctx.emit(aten.stack.default, ([total, count],), source=e.source)
    both = ctx.emit(C.all_reduce_sum, (both, ctx.mesh.sp_group), source=e.source)
    num = ctx.emit(aten.select.int, (both, 0, 0), source=e.source)
    den = ctx.emit(aten.select.int, (both, 0, 1), source=e.source)
    ctx.env[e.outputs[0].name] = cast(ctx.emit(aten.div.Tensor, (num, den), source=e.source))


def attention_rule(ctx: ShardCtx, e: Eqn) -> None:
    """Ulysses: Q, K, V all-to-all in one collective (`b h (sp s) d -> b (sp h) s d`), full-sequence
    attention on h/P heads, the inverse all-to-all after. Masks stay exact; padding is masked."""
    if e.op.target is not aten.scaled_dot_product_attention.default:
        raise ShardError(f"{describe(ctx, e)}: only aten.scaled_dot_product_attention is sharded; this trace "
                         "holds a backend attention op. Fix: shard the forward loss (autosp.shard / "
                         "value_and_grad differentiate it), not a function that calls torch.func.grad.")
    b = e.bind_schema()
    q_old, k_old, v_old = e.inputs[:3]
    gqa = bool(b.get("enable_gqa"))
    k_src, v_src = unrepeated_kv(ctx, k_old), unrepeated_kv(ctx, v_old)
    if k_src is not None and v_src is not None and k_src[1] == v_src[1] and q_old.shape[-3] == k_old.shape[-3]:
        # HF's repeat_kv (unsqueeze, expand, reshape) copies K and V to every query head; attention
        # reads the unrepeated K/V with enable_gqa instead: less memory, half the all-to-all traffic
        k_old, v_old, gqa = k_src[0], v_src[0], True
    p = ctx.mesh.sp_size
    q, k, v = (ctx.as_sharded(t, e.source) for t in (q_old, k_old, v_old))
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.layout is None or t.layout.dim != t.ndim - 2 or t.ndim < 3:
            raise ShardError(f"{describe(ctx, e)}: the {name} is not sharded along its sequence dim (-2). "
                             "Fix: pass in_specs naming the sequence dim of the inputs.")
    hq = q.shape[-3]
    u = ulysses_size(ctx, e, hq)
    if u < p:                                   # heads run out: all-to-all over u ranks, a ring over p / u
        return _ring_attention(ctx, e, b, (q, k, v), u, gqa)
    k, v = _whole_kv_groups(ctx, e, k, v, p)
    hdim = q.ndim - 3
    q2, k2, v2 = ctx.emit(C.all_to_all, ([q, k, v], hdim, hdim + 1, ctx.mesh.sp_group), source=e.source)
    length, padded = q.layout.length, q.layout.chunk * p
    mask, is_causal, fn = _read_mask(ctx, e, b, length)
    if fn is not None:
        # the mask as a function of O(s) leaves: no s x s tensor on any rank
        o2 = _masked_attention(ctx, e, fn, (q2, k2, v2), length, padded, b["scale"])
        (o,) = ctx.emit(C.all_to_all, ([o2], hdim + 1, hdim, ctx.mesh.sp_group), source=e.source,
                        layouts=[Layout(q.ndim - 2, length, q.layout.chunk)])
        ctx.env[e.outputs[0].name] = o
        return
    if mask is not None:
        if mask.ndim >= 3 and mask.shape[-3] != 1:
            raise ShardError(f"{describe(ctx, e)}: a per-head attention mask ({mask.type_str()}) is not sharded "
                             "yet. Fix: use one mask for all heads ([b, 1, s, s]).")
        mask = ctx.as_replicated(mask, e.source)
        if padded > q_old.shape[-2]:
            mask = ctx.emit(autosp_ops.pad_attn_mask, (mask, padded), source=e.source)
    elif padded > length and not is_causal:
        mask = ctx.emit(autosp_ops.key_padding_mask, (length, padded, torch.device(q.device)), source=e.source)
    # one attention op; which kernel runs it is lowering's choice (autosp/ir/lower.py, attention_kernel)
    kw = {"attn_mask": mask, "dropout_p": b["dropout_p"], "is_causal": is_causal, "scale": b["scale"]}
    if gqa:
        kw["enable_gqa"] = True
    o2 = ctx.emit(e.op.target, (q2, k2, v2), kw, source=e.source)
    (o,) = ctx.emit(C.all_to_all, ([o2], hdim + 1, hdim, ctx.mesh.sp_group), source=e.source,
                    layouts=[Layout(q.ndim - 2, length, q.layout.chunk)])
    ctx.env[e.outputs[0].name] = o


def _read_mask(ctx: ShardCtx, e: Eqn, b: dict, length: int):
    """(mask, is_causal, fn) of an SDPA equation: HF's causal mask tensor (cache off) becomes is_causal, so
    the s x s mask is never built (its equations are dead code); `fn` is the mask as a function of O(s)
    leaves (masks.py), or None where it is not one. A leaf computed from parameters or float inputs would
    need a gradient, which the attention ops do not give their leaves: such a mask stays a tensor."""
    mask, is_causal = b["attn_mask"], b["is_causal"]
    if mask is not None and is_causal_mask(ctx.constant_value(mask)):
        return None, True, None
    fn = None
    if mask is not None and not b["dropout_p"] and os.environ.get("AUTOSP_MASK_FUNCTIONS", "1") != "0":
        fn = mask_function(ctx.graph, mask, length, math.prod(e.inputs[0].shape[:-3]), ctx.constant_value)
        if fn is not None and any(x.name in ctx.heavy for x in fn.leaves):
            fn = None
    return mask, is_causal, fn


def _whole_kv_groups(ctx: ShardCtx, e: Eqn, k: Var, v: Var, ranks: int) -> tuple[Var, Var]:
    """K and V with their heads repeated to a multiple of `ranks`, so each rank of an all-to-all over
    them gets whole GQA groups."""
    hkv = k.shape[-3]
    if hkv % ranks == 0:
        return k, v
    rep = math.lcm(hkv, ranks) // hkv
    return tuple(ctx.emit(aten.repeat_interleave.self_int, (t, rep, t.ndim - 3), source=e.source,
                          layouts=[t.layout]) for t in (k, v))


def ulysses_size(ctx: ShardCtx, e: Eqn, heads: int) -> int:
    """U of sp = U x R: the all-to-all group's size. Forced by `ring=R`; else the largest divisor of the sp
    size that divides the query heads (an all-to-all moves less than a ring)."""
    p, ring = ctx.mesh.sp_size, ctx.mesh.ring
    if ring is not None:
        if ring < 1 or p % ring:
            raise ShardError(f"{describe(ctx, e)}: ring={ring} does not divide sp={p}. Fix: a ring size that divides "
                             f"{p} ({', '.join(str(d) for d in range(1, p + 1) if p % d == 0)}).")
        u = p // ring
        if heads % u:
            raise ShardError(f"{describe(ctx, e)}: ring={ring} leaves an all-to-all over {u} ranks, which {heads} "
                             f"query heads cannot be split over. Fix: a ring size r with {heads} % ({p} / r) == 0.")
        return u
    return factorise(p, heads)[0]


def factorise(p: int, heads: int) -> tuple[int, int]:
    """(U, R) with U x R = p: U the largest divisor of p that divides the query heads (Ulysses where it
    can be, a ring over the rest)."""
    u = max(d for d in range(1, p + 1) if p % d == 0 and heads % d == 0)
    return u, p // u


def _ring_attention(ctx: ShardCtx, e: Eqn, b: dict, qkv, u: int, gqa: bool) -> None:
    """sp = U x R: Q, K, V all-to-all over the U ranks that hold one contiguous segment of the sequence
    (`b h (U s) d -> b (U h) s d` within it), then ring attention over the R segments (autosp/ring.py:
    K/V blocks passed around, partial outputs merged by log-sum-exp), causal work balanced by the zigzag
    order (each ring rank holds chunks r and 2R-1-r while attention runs), and the inverse all-to-all.
    A mask that mask_function reads as a function (packed documents, windows) runs as
    autosp::ring_masked_attention with its leaves replicated and padded as on the Ulysses path."""
    from autosp import ring as RING
    q, k, v = qkv
    mask, is_causal, fn = _read_mask(ctx, e, b, q.layout.length)
    is_causal = bool(is_causal)
    if (mask is not None and fn is None) or b["dropout_p"]:
        raise ShardError(f"{describe(ctx, e)}: {q.shape[-3]} query heads cannot be split over sp={ctx.mesh.sp_size}, "
                         "and ring attention (sp = all-to-all x ring) takes causal or unmasked attention, or a mask "
                         "that is a function of positions and per-position vectors (packed documents, windows), "
                         "without dropout only; this one has "
                         + ("a mask that is not such a function (read from an input, per head, or computed from "
                            "parameters)" if mask is not None else "dropout") + ". Fix: an sp size that divides "
                         f"the {q.shape[-3]} heads, or build the mask from position or document ids.")
    if q.ndim != 4:
        raise ShardError(f"{describe(ctx, e)}: ring attention takes [b, h, s, d] query, key and value, not "
                         f"{q.type_str()}. Fix: an sp size that divides the {q.shape[-3]} heads.")
    k, v = _whole_kv_groups(ctx, e, k, v, u)
    ugroup, rgroup = C.ring_groups(ctx.mesh.sp_ranks, u)
    layout = Layout(2, q.layout.length, q.layout.chunk)
    if u > 1:
        q, k, v = ctx.emit(C.all_to_all, ([q, k, v], 1, 2, ugroup), source=e.source)
    # zigzag balances causal work; masks from HF (documents, windows) are causal too. The masked op
    # evaluates its blocks at global positions, so the leaves need no exchange.
    zigzag = (is_causal or fn is not None) and q.shape[2] % 2 == 0
    if zigzag:
        exchange = RING.zigzag_exchange_op._opoverload
        q, k, v = (ctx.emit(exchange, (t, 2, rgroup, False), source=e.source) for t in (q, k, v))
    scale = b["scale"] if b["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    last = u == 1 and not zigzag                 # the op whose output is back in the sequence layout
    args = (q, k, v, is_causal, float(scale), layout.length, zigzag, rgroup)
    op = RING.ring_attention_op
    if fn is not None:
        # the whole ring's padded sequence is the global one: R * s = sp * chunk
        args += (_mask_leaves(ctx, e, fn, layout.length, layout.chunk * ctx.mesh.sp_size), fn.expr)
        op = RING.ring_masked_attention_op
    o, _ = ctx.emit(op._opoverload, args, source=e.source, layouts=[layout, None] if last else None)
    if zigzag:
        o = ctx.emit(RING.zigzag_exchange_op._opoverload, (o, 2, rgroup, True), source=e.source,
                     layouts=None if u > 1 else [layout])
    if u > 1:
        (o,) = ctx.emit(C.all_to_all, ([o], 2, 1, ugroup), source=e.source, layouts=[layout])
    ctx.env[e.outputs[0].name] = o


def _masked_attention(ctx: ShardCtx, e: Eqn, fn, qkv, length: int, padded: int, scale) -> Var:
    """autosp::masked_attention on the head-sharded q, k, v: the mask's leaves replicated (O(b s)),
    viewed [batch, Lq or 1, Lk or 1] and padded to whole chunks; keys past `length` are padding."""
    leaves = _mask_leaves(ctx, e, fn, length, padded)
    from autosp.kernels.masked import masked_attention_op
    o2, _ = ctx.emit(masked_attention_op._opoverload, tuple(qkv) + (leaves, fn.expr, scale, length, "auto"),
                     source=e.source)
    return o2


def _mask_leaves(ctx: ShardCtx, e: Eqn, fn, length: int, padded: int) -> list[Var]:
    """The mask's leaves replicated (O(b s)), viewed [batch, Lq or 1, Lk or 1], padded to `padded`."""
    leaves = []
    for leaf, side in zip(fn.leaves, fn.sides):
        t = ctx.as_replicated(leaf, e.source)
        shape = (1, 1) + tuple(leaf.shape)
        t = ctx.emit(aten.reshape.default, (t, [math.prod(shape[:-2]), shape[-2], shape[-1]]), source=e.source)
        if padded > length and side:
            pad = [0, 0, 0, padded - length] if side == "q" else [0, padded - length]
            t = ctx.emit(aten.constant_pad_nd.default, (t, pad, 0), source=e.source)
        leaves.append(t)
    return leaves


def region_rule(ctx: ShardCtx, graph, region) -> None:
    """Attention written out (scores, softcap, mask, softmax, probs @ v): Ulysses around the whole
    region. q, k and v go to `b (sp h) s d` in one all-to-all (padding dropped: inside, the sequence
    is exactly L), the region's equations run on h/P heads over the full sequence, the output comes
    back to `b h (sp s) d` in one all-to-all. Values from outside the region (masks, biases) are read
    whole, cut to this rank's heads where they have a head dim."""
    eqns = [graph.eqns[k] for k in sorted(region.eqns)]
    where = graph.eqns[region.last].source
    q_old, k_old, v_old = region.q, region.k, region.v
    q, k, v = (ctx.as_sharded(t, where) for t in (q_old, k_old, v_old))
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.layout is None or t.layout.dim != t.ndim - 2:
            raise ShardError(f"attention written out at {where}: the {name} {t.type_str()} is not sharded along its "
                             "sequence dim (-2). Fix: pass in_specs naming the sequence dim of the inputs.")
    p = ctx.mesh.sp_size
    hdim = q.ndim - 3
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.shape[hdim] % p:
            raise ShardError(f"attention written out at {where}: {t.shape[hdim]} {name} heads cannot be split over "
                             f"sp={p} (Ulysses gives each rank heads/sp heads). Fix: use an sp size that divides "
                             f"{t.shape[hdim]}, or repeat the key/value heads to a multiple of {p}.")
    length = q_old.shape[-2]
    q2, k2, v2 = ctx.emit(C.all_to_all, ([q, k, v], hdim, hdim + 1, ctx.mesh.sp_group), source=where)
    if q2.shape[-2] != length:                          # padded chunks: inside, exactly L positions
        q2, k2, v2 = (ctx.emit(aten.narrow.default, (t, t.ndim - 2, 0, length), source=where) for t in (q2, k2, v2))
    local = {region.q.name: q2, region.k.name: k2, region.v.name: v2}
    heads = q_old.shape[hdim]

    def outside(x: Var) -> Var:
        new = ctx.as_replicated(x, where)
        d = new.ndim - (q_old.ndim - hdim)              # the head dim, aligned from the right
        if 0 <= d and new.ndim >= q_old.ndim - hdim and new.shape[d] == heads and heads > 1:
            new = ctx.emit(C.shard_slice, (new, d, 1, heads // p, 1, ctx.mesh.sp_group), source=where)
        return new

    for e in eqns:
        ins = [local[x.name] if x.name in local else outside(x) for x in e.inputs]
        args, kwargs = e.bind(ins)
        outs = ctx.emit(e.op.target, args, kwargs, source=e.source)
        outs = outs if isinstance(outs, tuple) else (outs,)
        for o, n in zip(e.outputs, outs):
            local[o.name] = n
    out = local[region.out.name]
    padded = q.layout.chunk * p
    if padded != length:                                # back to whole chunks for the all-to-all
        out = ctx.emit(aten.constant_pad_nd.default, (out, [0, 0, 0, padded - length]), source=where)
    (o,) = ctx.emit(C.all_to_all, ([out], hdim + 1, hdim, ctx.mesh.sp_group), source=where,
                    layouts=[Layout(out.ndim - 2, length, q.layout.chunk)])
    ctx.env[region.out.name] = o


def unrepeated_kv(ctx: ShardCtx, kv: Var) -> tuple[Var, int] | None:
    """(x, n) when kv = reshape(expand(unsqueeze(x, -3), [.., h, n, s, d]), [.., h * n, s, d])."""
    e1 = ctx.producer.get(kv.name)
    if e1 is None or e1.op.name not in ("reshape", "view", "_unsafe_view") or kv.ndim != 4:
        return None
    e2 = ctx.producer.get(e1.inputs[0].name)
    if e2 is None or e2.op.name != "expand" or e2.outputs[0].ndim != 5:
        return None
    e3 = ctx.producer.get(e2.inputs[0].name)
    if e3 is None or e3.op.name != "unsqueeze" or _norm(e3.bind_schema()["dim"], 5) != 2:
        return None
    x, rep = e3.inputs[0], e2.outputs[0]
    b, h, n, s, d = rep.shape
    if x.shape != (b, h, s, d) or kv.shape != (b, h * n, s, d):
        return None
    return x, n


def is_causal_mask(mask) -> bool:
    """A bool mask that is tril(ones), or an additive one that is 0 there and hugely negative above,
    broadcast over its leading dims."""
    if mask is None or mask.ndim < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    n = mask.shape[-1]
    tril = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool(((mask == 0) | blocked).all()):
            return False
        allowed = ~blocked
    else:
        return False
    return bool((allowed == tril).all())


def addmm_rule(ctx: ShardCtx, e: Eqn) -> None:
    """addmm(bias, a, b) / baddbmm: rows of `a` position-wise; the sequence contracted in `b`: fall back."""
    bias, a, b = (ctx.env[x.name] for x in e.inputs[:3])
    if (b.layout is not None and b.layout.dim >= b.ndim - 2) or (a.layout is not None and a.layout.dim == a.ndim - 1):
        return gather_fallback(ctx, e)
    positionwise(ctx, e)


def einsum_rule(ctx: ShardCtx, e: Eqn) -> None:
    """einsum: position-wise when the sequence letter survives to the output in every operand that has it."""
    args, _ = e.var_args()
    eq = args[0] if args else None
    if not isinstance(eq, str) or "->" not in eq or "..." in eq:
        return gather_fallback(ctx, e)
    ins, out = eq.replace(" ", "").split("->")
    for x, letters in zip(e.inputs, ins.split(",")):
        lay = ctx.env[x.name].layout
        if lay is not None and letters[lay.dim] not in out:
            return gather_fallback(ctx, e)
    positionwise(ctx, e)


def scatter_rule(ctx: ShardCtx, e: Eqn) -> None:
    """slice_scatter / select_scatter: position-wise unless the window is along the sequence."""
    base = ctx.env[e.inputs[0].name]
    out = e.outputs[0]
    d = e.bind_schema().get("dim", 0)
    p = ctx.pos.get(out.name)
    if p is not None and _norm(d, out.ndim) == p.dim:
        return gather_fallback(ctx, e)
    if base.layout is None and ctx.wants_shard(out):
        ctx.env[e.inputs[0].name] = ctx.as_sharded(e.inputs[0], e.source)
    positionwise(ctx, e)


def repeat_interleave_rule(ctx: ShardCtx, e: Eqn) -> None:
    """repeat_interleave(x, r: int, dim) along the sequence: each rank repeats its own positions (the
    layout gains an inner factor r); a tensor of repeats falls back."""
    x = ctx.env[e.inputs[0].name]
    b = e.bind_schema()
    if x.layout is None or b.get("dim") is None or _norm(b["dim"], x.ndim) != x.layout.dim:
        return seq_dim_arg("dim")(ctx, e)
    if not isinstance(b.get("repeats"), int) or e.outputs[0].name not in ctx.pos:
        return gather_fallback(ctx, e)
    positionwise(ctx, e)


def repeat_rule(ctx: ShardCtx, e: Eqn) -> None:
    """x.repeat(sizes): tiles of the whole dim. Where the sequence's dim is not tiled, or the tiles stay one
    sequence with an outer factor (seqdims' links_repeat: [(r outer) s inner], as MoE's `hidden.repeat(E, 1)`
    over `(b s)` rows), each rank tiles its own chunk: the local tiles are the global ones' chunks in the
    same order. Anything else (the output's sequence not found) is gathered, tiled whole and sharded."""
    x = ctx.env[e.inputs[0].name]
    out = e.outputs[0]
    if x.layout is None:
        return positionwise(ctx, e)
    p = ctx.pos.get(out.name)
    sizes = list(e.bind_schema()["repeats"])
    off = out.ndim - x.ndim
    lay = x.layout
    tiled = sizes[lay.dim + off]
    if p is None or p.dim != lay.dim + off or p.inner != lay.inner or p.outer != lay.outer * tiled:
        return gather_fallback(ctx, e)
    positionwise(ctx, e)


def index_rule(ctx: ShardCtx, e: Eqn) -> None:
    """x[idx]: an index tensor that carries the sequence into a replicated table (expert weights
    gathered per token) is position-wise, so is a sharded x indexed along other dims; else fall back."""
    b = e.bind_schema()
    x = ctx.env[e.inputs[0].name]
    idx_old = [t for t in (b.get("indices") or []) if isinstance(t, Var)]
    idx = [ctx.env[t.name] for t in idx_old]
    out = e.outputs[0]
    if out.name not in ctx.pos:
        return gather_fallback(ctx, e)
    links_ok = any(t.name in ctx.pos for t in idx_old) and x.layout is None
    if x.layout is not None:
        indices = list(b.get("indices") or [])
        first = next((i for i, t in enumerate(indices) if t is not None), None)
        links_ok = first is not None and x.layout.dim < first and all(t.layout is None for t in idx)
    if not links_ok:
        return gather_fallback(ctx, e)
    indices = list(b.get("indices") or [])
    p = ctx.pos.get(e.inputs[0].name)
    if x.layout is None and p is not None and p.dim < len(indices) and indices[p.dim] is not None:
        # the indices carry the sequence, with global values: the table they read stays whole even where
        # it has a sequence dim of its own (positions read at the query indices of a causal mask's rows)
        ins = [x] + [ctx.as_sharded(t, e.source) if t.name in ctx.pos else ctx.env[t.name] for t in e.inputs[1:]]
        length = min(v.layout.length for v in ins[1:] if v.layout is not None)
        args, kwargs = e.bind(ins)
        ctx.env[out.name] = ctx.emit(e.op.target, args, kwargs, source=e.source, layouts=[ctx.layout_for(out, length)])
        return
    positionwise(ctx, e, force=True)


def histc_rule(ctx: ShardCtx, e: Eqn) -> None:
    """histc over a sharded value: each rank counts its valid positions, one all-reduce sums the counts.
    Padding is moved below `min`, which histc ignores; an automatic range (min == max) falls back."""
    x = ctx.env[e.inputs[0].name]
    if x.layout is None:
        return positionwise(ctx, e)
    b = e.bind_schema()
    lo, hi = float(b["min"]), float(b["max"])
    if not lo < hi:
        return gather_fallback(ctx, e)
    mask = ctx.valid_mask(x)
    if mask is not None:
        x = ctx.emit(aten.where.ScalarOther, (mask, x, lo - 1.0), source=e.source)
    part = ctx.emit(aten.histc.default, (x, b["bins"], lo, hi), source=e.source)
    ctx.env[e.outputs[0].name] = ctx.emit(C.all_reduce_sum, (part, ctx.mesh.sp_group), source=e.source)


def creation_rule(ctx: ShardCtx, e: Eqn) -> None:
    """new_zeros / new_empty / zeros / full ...: a constant fill; where it holds an activation's sequence
    (it is written into), it is made at the local size, else replicated."""
    out = e.outputs[0]
    b = e.bind_schema()
    if not ctx.wants_shard(out) or "size" not in b:
        return replicate(ctx, e)
    lay = ctx.layout_for(out)
    args, kwargs = e.bind([ctx.env[x.name] for x in e.inputs])
    names = [a.name for a in e.op.target._schema.arguments]
    k = names.index("size")
    size = list(lay.local_shape(out.shape))
    if k < len(args):
        args = args[:k] + (size,) + args[k + 1:]
    else:
        kwargs = {**kwargs, "size": size}
    ctx.env[out.name] = ctx.emit(e.op.target, args, kwargs, source=e.source, layouts=[lay])


def no_rule(ctx: ShardCtx, e: Eqn) -> None:
    """No rule names this op: probe it (probe.py). Position-wise along the sequence -> it runs on the
    chunk; mixing positions -> an error that says so; unprobeable -> an error naming the missing rule."""
    if not _sharded_inputs(ctx, e) and not any(ctx.wants_shard(o) for o in e.outputs):
        return replicate(ctx, e)
    from autosp.passes.probe import is_positionwise, probeable
    seq = {i: ctx.pos[x.name] for i, x in enumerate(e.inputs) if x.name in ctx.pos}
    out = {j: ctx.pos[o.name] for j, o in enumerate(e.outputs) if o.name in ctx.pos}
    simple = all(p.outer == 1 and p.inner == 1 for p in list(seq.values()) + list(out.values()))
    if not probeable(e) or not simple or not out:
        raise ShardError(f"{describe(ctx, e)}: autosp has no sharding rule for `{e.op.name}` and cannot derive one "
                         "(it takes size arguments, or the sequence does not come out of it as one dim). "
                         "Fix: file the op with autosp, or pass in_specs that leave its inputs replicated.")
    if is_positionwise(e, {i: p.dim for i, p in seq.items()}, {j: p.dim for j, p in out.items()}):
        return positionwise(ctx, e, force=True)
    raise ShardError(f"{describe(ctx, e)}: `{e.op.name}` mixes positions along the sequence (run on the first "
                     "positions alone it gives other values), so each rank cannot compute its part alone, and "
                     "autosp has no collective for it. Fix: compute it on a value without the sequence, or pass "
                     "in_specs that leave its inputs replicated.")


POSITIONWISE_NAMES = {
    "linear", "embedding", "view", "reshape", "_unsafe_view", "expand", "expand_as", "permute", "transpose", "t",
    "unsqueeze", "squeeze", "contiguous", "alias", "clone", "detach", "lift_fresh_copy", "to.dtype", "to.device",
    "to.dtype_layout", "to.other", "_to_copy.default", "type_as.default", "dropout", "native_dropout",
    "where.self", "masked_fill.Scalar", "masked_fill.Tensor", "zeros_like", "ones_like", "full_like",
    "empty_like", "rand_like", "randn_like", "bernoulli", "flatten", "unflatten", "view_as", "reshape_as",
    "rms_norm",
}

RULES: dict[str, Rule] = {name: positionwise for name in POSITIONWISE_NAMES | ELEMENTWISE_UNTAGGED}
RULES.update({
    "attention": attention_rule, "cross_entropy": loss_rule, "nll_loss": loss_rule,
    "slice": slice_rule, "narrow": slice_rule, "select": seq_dim_arg("dim"), "cat": cat_rule, "pad": pad_rule,
    "sum": reduce_rule, "mean": reduce_rule, "amax": reduce_rule, "amin": reduce_rule, "max": reduce_rule,
    "min": reduce_rule, "logsumexp": reduce_rule, "prod": reduce_rule, "any": reduce_rule, "all": reduce_rule,
    "var": reduce_rule, "std": reduce_rule, "argmax": reduce_rule, "argmin": reduce_rule, "norm": reduce_rule,
    "softmax": seq_dim_arg("dim"), "_softmax": seq_dim_arg("dim"), "log_softmax": seq_dim_arg("dim"),
    "_log_softmax": seq_dim_arg("dim"), "cumsum": seq_dim_arg("dim"), "split": seq_dim_arg("dim", 0),
    "split_with_sizes": seq_dim_arg("dim", 0), "chunk": seq_dim_arg("dim", 0), "tensor_split.indices": tensor_split_rule, "unbind": seq_dim_arg("dim", 0),
    "flip": seq_dim_arg("dims"), "roll": seq_dim_arg("dims"), "repeat_interleave": repeat_interleave_rule,
    "repeat": repeat_rule,
    "tril": gather_fallback, "triu": gather_fallback, "index_select": gather_fallback, "gather": seq_dim_arg("dim"),
    "index": index_rule, "layer_norm": layer_norm_rule, "native_layer_norm": layer_norm_rule,
    "matmul": matmul_rule, "addmm": addmm_rule, "einsum": einsum_rule,
    "stack": positionwise, "view_as_complex": positionwise, "view_as_real": positionwise,
    "topk": seq_dim_arg("dim", -1), "sort": seq_dim_arg("dim", -1), "argsort": seq_dim_arg("dim", -1),
    "kthvalue": seq_dim_arg("dim", -1), "slice_scatter": scatter_rule, "select_scatter": scatter_rule,
    "scatter": seq_dim_arg("dim"), "scatter_add": seq_dim_arg("dim"), "index_add": seq_dim_arg("dim"),
    # grouped_mm's offsets count the whole sequence's rows; inside a dispatch region (dispatch.py) they
    # are the rank's own, elsewhere the rows are gathered
    "grouped_mm": gather_fallback,
    "histc": histc_rule, "new_empty": creation_rule, "new_zeros": creation_rule, "new_ones": creation_rule, "new_full": creation_rule,
})


def rule_for(e: Eqn) -> Rule:
    rule = RULES.get(e.op.name)
    if rule is not None:
        return rule
    if e.op.has(Tag.ELEMENTWISE) and not e.op.has(Tag.INPLACE):
        return positionwise
    return no_rule


# op families in modules of their own register into RULES (and seqdims.LINK_RULES) on import
import autosp.passes.halo  # noqa: E402,F401 - convolutions along the sequence
import autosp.passes.query_rows  # noqa: E402,F401 - values with two sequence dims (a sparse-attention indexer)

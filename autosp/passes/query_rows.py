"""Values with two sequence dims, `[.., s_q, .., s_k]`: each rank holds its query rows and every key.

A sparse-attention indexer (DeepSeek-V3.2's) scores every query against every key with a few index heads,
sums those heads and keeps each query's top k keys; the kept keys become a bool mask `[b, 1, s, s]` that
joins the causal one before attention. Nothing there is independent per attention head, so it is no
head-parallel region; it is independent per query row. seqdims gives these values the query dim as their
sequence (the rows, linked from the index queries), and the rules here keep the key dim whole:

- matmul whose right operand carries the sequence in its columns (`q_idx @ k_idx^T`): the right operand is
  all-gathered (the index keys, `[b, s, d_idx]`: small) and this rank's rows are computed, O(s/P * s);
- attention whose mask is such a value (its rows made on this rank from activations): the queries stay
  sequence-sharded and attend to K and V all-gathered, with this rank's rows of the mask. No rank holds
  the s x s mask, but each holds every head's K and V (P times Ulysses' share) and the gathers' backward
  all-reduces their grads; the memory model prices both as the collectives they are.

Padded query rows (a length sp does not divide) attend to every key, so no row is fully masked (a NaN in the
backward); their outputs are padding and never reach the loss.
"""
from __future__ import annotations

import torch

from autosp import collectives as C
from autosp.ir.core import Eqn
from autosp.layout import Layout
from autosp.passes import shard_rules as R
from autosp.passes.shard_ctx import ShardCtx

aten = torch.ops.aten


def matmul_rows_rule(ctx: ShardCtx, e: Eqn) -> None:
    """Rows of the left operand sharded, the sequence in the right operand's columns: the right operand
    whole, the rows local. Anything else: shard_rules.matmul_rule."""
    if len(e.inputs) < 2:
        return R.matmul_rule(ctx, e)
    a_old, b_old = e.inputs[:2]
    out = e.outputs[0]
    a, b = ctx.env[a_old.name], ctx.env[b_old.name]
    p_out = ctx.pos.get(out.name)
    columns = b.layout is not None and b.ndim >= 2 and b.layout.dim == b.ndim - 1
    rows = a.layout is not None and a.layout.dim < a.ndim - 1
    if not (columns and rows and p_out is not None and p_out.dim < out.ndim - 1):
        return R.matmul_rule(ctx, e)
    whole = ctx.as_replicated(b_old, e.source)
    args, kwargs = e.bind([a, whole])
    ctx.env[out.name] = ctx.emit(e.op.target, args, kwargs, source=e.source,
                                 layouts=[ctx.layout_for(out, a.layout.length)])


def _row_mask(ctx: ShardCtx, e: Eqn, mask_old):
    """The mask's local rows, when they were made on this rank from activations (`[.., chunk, s]`)."""
    if mask_old is None or mask_old.name not in ctx.heavy:
        return None
    m = ctx.env[mask_old.name]
    if m.layout is None or m.layout.dim != m.ndim - 2 or m.shape[-1] != mask_old.shape[-1]:
        return None
    return m


def attention_rows_rule(ctx: ShardCtx, e: Eqn) -> None:
    """SDPA with a mask whose rows this rank made: its queries against K and V gathered whole. Any
    other attention: shard_rules.attention_rule (Ulysses, the ring)."""
    if e.op.target is not aten.scaled_dot_product_attention.default:
        return R.attention_rule(ctx, e)
    b = e.bind_schema()
    mask = _row_mask(ctx, e, b["attn_mask"])
    if mask is None:
        return R.attention_rule(ctx, e)
    q_old, k_old, v_old = e.inputs[:3]
    q = ctx.as_sharded(q_old, e.source)
    if q.layout is None or q.layout.dim != q.ndim - 2:
        return R.attention_rule(ctx, e)
    k, v = (ctx.as_replicated(t, e.source) for t in (k_old, v_old))
    valid = ctx.valid_mask(mask)
    if valid is not None:                       # padded query rows: every key, never a fully masked row
        pad_rows = ctx.emit(aten.logical_not.default, (valid,), source=e.source)
        if mask.dtype == torch.bool:
            mask = ctx.emit(aten.logical_or.default, (mask, pad_rows), source=e.source, layouts=[mask.layout])
        else:
            mask = ctx.emit(aten.masked_fill.Scalar, (mask, pad_rows, 0.0), source=e.source, layouts=[mask.layout])
    kw = {"attn_mask": mask, "dropout_p": b["dropout_p"], "is_causal": False, "scale": b["scale"]}
    if b.get("enable_gqa"):
        kw["enable_gqa"] = True
    ctx.env[e.outputs[0].name] = ctx.emit(e.op.target, (q, k, v), kw, source=e.source,
                                          layouts=[Layout(q.ndim - 2, q.layout.length, q.layout.chunk)])


R.RULES["matmul"] = matmul_rows_rule
R.RULES["attention"] = attention_rows_rule

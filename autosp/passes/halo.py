"""Convolutions along the sequence: the short causal convolution (LFM2, Mamba, Bamba) runs on the chunk
after a halo exchange; other convolutions are position-wise over their batch or take the exact gather.

The pattern the models trace, `conv1d(x, w, b, stride 1, padding d(k-1), dilation d)[..., :s]` with the
sequence in x's last dim: output t reads inputs t - d(k-1) .. t, so each rank needs only the d(k-1)
positions before its chunk (`autosp::halo_exchange`; rank 0 gets the zeros the padding gave) and runs the
convolution unpadded on [halo, chunk]: exactly its chunk of outputs. The trailing d(k-1) outputs, which read
the right-hand padding, exist on no rank, so every consumer must be the slice to the first s; the slice
then keeps the chunk as it is (shard_rules.slice_rule). Grouped (depthwise) or not makes no difference:
channels never cross ranks.

This module registers its rules into shard_rules.RULES and seqdims.LINK_RULES.
"""
from __future__ import annotations

import torch

from autosp import collectives as C
from autosp.errors import ShardError
from autosp.ir.core import Eqn, Var
from autosp.layout import Layout
from autosp.passes.seqdims import LINK_RULES, Link, dim_link
from autosp.passes.shard_ctx import ShardCtx
from autosp.passes.shard_rules import INT64_MAX, RULES, describe, gather_fallback, positionwise, replicate

aten = torch.ops.aten

_CONV_NAMES = ("conv1d.default", "conv1d.padding", "convolution.default")


def _conv_args(e: Eqn) -> dict | None:
    """A 1-d convolution's (stride, padding, dilation, groups, transposed) as ints, or None for any other
    convolution (2-d, 3-d) or a padding aten states as a string other than 'valid' / 'same'."""
    b = e.bind_schema()
    w = e.inputs[1]
    if w.ndim != 3:
        return None
    one = lambda v: int(v[0]) if isinstance(v, (list, tuple)) else int(v)
    k, dil = w.shape[-1], one(b["dilation"])
    pad = b["padding"]
    if isinstance(pad, str):                   # conv1d.padding: 'valid' is none, 'same' pads both sides
        if pad not in ("valid", "same"):
            return None
        pad = 0 if pad == "valid" else dil * (k - 1) // 2
    return dict(stride=one(b["stride"]), padding=one(pad), dilation=dil, kernel=k, groups=int(b["groups"]),
                transposed=bool(b.get("transposed") or False))


def _conv_text(a: dict | None) -> str:
    if a is None:
        return "not 1-d"
    return ", ".join(f"{k} {int(a[k])}" for k in ("padding", "stride", "dilation", "groups")) + \
        (", transposed" if a["transposed"] else "")


def links_conv(e: Eqn) -> list[Link]:
    """A stride-1 convolution keeps its input's positions in the same dims of its output (shifted by the
    padding, which the sharding rule reads): the batch and the last dim link."""
    a = _conv_args(e)
    if a is None or a["stride"] != 1 or a["transposed"]:
        return []
    x, out = e.inputs[0], e.outputs[0]
    m = {x.ndim - 1: out.ndim - 1}
    if x.ndim == 3:
        m[0] = 0
    return [dim_link(x, out, m)]


def _consumers(ctx: ShardCtx, name: str) -> list[Eqn]:
    key = ("consumers",)
    if ctx.graph is None:
        return []
    if key not in ctx._cache:
        users: dict[str, list[Eqn]] = {}
        for e in ctx.graph.eqns:
            for x in {x.name for x in e.inputs}:
                users.setdefault(x, []).append(e)
        for o in ctx.graph.outputs:
            if isinstance(o, Var):
                users.setdefault(o.name, []).append(None)
        ctx._cache[key] = users
    return ctx._cache[key].get(name, [])


def _first_positions_only(ctx: ShardCtx, out: Var, dim: int, n: int) -> bool:
    """Whether every reader of the convolution's output takes a prefix of at most n positions along `dim`
    (`y[..., :s]`): the trailing outputs, which read past the sequence, are then never used."""
    users = _consumers(ctx, out.name)
    if not users:
        return False
    for u in users:
        if u is None or u.op.name not in ("slice", "narrow") or u.inputs[0].name != out.name:
            return False
        b = u.bind_schema()
        if (b["dim"] + out.ndim) % out.ndim != dim:
            return False
        if u.op.name == "narrow":
            start, end, step = b["start"], b["start"] + b["length"], 1
        else:
            start, end, step = b["start"] or 0, b["end"], b["step"] or 1
            end = out.shape[dim] if end is None or end >= INT64_MAX else end
        if start != 0 or step != 1 or end < 0 or end > n:
            return False
    return True


def conv_rule(ctx: ShardCtx, e: Eqn) -> None:
    """A 1-d convolution with a sharded input: over the batch it is position-wise; along the sequence, a causal
    one (padding d(k-1), stride 1, only its first s outputs read) is a halo exchange and the local convolution;
    any other along the sequence takes the exact gather."""
    x_old, out_old = e.inputs[0], e.outputs[0]
    x = ctx.as_sharded(x_old, e.source) if x_old.name in ctx.pos else ctx.env[x_old.name]
    if x.layout is None:
        return replicate(ctx, e)
    a = _conv_args(e)
    lay = x.layout
    if a is not None and x.ndim == 3 and lay.dim == 0:
        return positionwise(ctx, e)          # the sequence in the batch dim, (b s) c l: each row alone
    if (a is not None and lay.dim == x.ndim - 1 and a["stride"] == 1 and not a["transposed"]
            and a["padding"] == 0 and a["kernel"] == 1):
        return positionwise(ctx, e)          # a kernel of one position mixes channels only
    n = lay.length
    causal = (a is not None and lay.dim == x.ndim - 1 and a["stride"] == 1 and not a["transposed"]
              and a["padding"] > 0 and a["padding"] == a["dilation"] * (a["kernel"] - 1)
              and lay.outer == 1 and lay.inner == 1
              and _first_positions_only(ctx, out_old, out_old.ndim - 1, x_old.shape[-1]))
    if not causal:
        p = ctx.pos.get(out_old.name)
        if p is not None and ctx.wants_shard(out_old) and p.length(out_old) > ctx.chunk * ctx.mesh.sp_size:
            raise ShardError(
                f"{describe(ctx, e)}: a convolution along the sequence (kernel {e.inputs[1].shape[-1]}, "
                f"{_conv_text(a)}) whose {p.length(out_old)} outputs outnumber the {n} positions of its input, and "
                f"whose readers use more than the first {n}: no rank holds the outputs past the sequence. autosp "
                "shards a convolution that is causal (stride 1, padding (kernel - 1) * dilation, the output sliced "
                f"to the first {n} positions); one whose output is no longer than its input takes the exact gather. "
                f"Fix: slice the output to `[..., :{n}]`, as a causal convolution does.")
        return gather_fallback(ctx, e)
    width = a["padding"]
    w = ctx.as_replicated(e.inputs[1], e.source)
    bias = ctx.as_replicated(e.inputs[2], e.source) if len(e.inputs) > 2 else None
    halo = ctx.emit(C.halo_exchange, (x, lay.dim, width, ctx.mesh.sp_group), source=e.source)
    seq = ctx.emit(aten.cat.default, ([halo, x], lay.dim), source=e.source)
    out_lay = Layout(lay.dim, n, lay.chunk)
    y = ctx.emit(aten.conv1d.default, (seq, w, bias, [1], [0], [a["dilation"]], a["groups"]), source=e.source,
                 layouts=[out_lay])
    mask = ctx.valid_mask(y)
    if mask is not None:
        # each input's gradient reads the outputs after it: those in the padding must carry none, whatever
        # reads them later (the single device slices them away)
        y = ctx.emit(aten.where.ScalarOther, (mask, y, 0.0), source=e.source, layouts=[out_lay])
    ctx.env[out_old.name] = y


for _name in _CONV_NAMES:
    RULES[_name] = conv_rule
    LINK_RULES[_name] = links_conv

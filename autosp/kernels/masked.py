"""`autosp::masked_attention`: attention under a mask given as a function, never as an s x s tensor.

    out = masked_attention(q, k, v, "(k <= q) & (x0[q] == x0[k])", leaves=[doc_ids[:, :, None]])
    out, lse = torch.ops.autosp.masked_attention(q, k, v, leaves, mask, scale, valid_len, backend)

Semantics: F.scaled_dot_product_attention(q, k, v, attn_mask=<the mask, dense, broadcast over
heads>, scale=scale, enable_gqa=True), with keys j >= valid_len masked as well (padding). q is
[b, hq, L, d], k and v [b, hkv, L, d] with hq % hkv == 0. The mask is an expression of
maskfn.py over q, k and the leaves. A row that may attend nothing gives out 0, lse -inf and
zero gradients (SDPA's CPU result for an all-False bool row). lse is the natural-log
logsumexp of the masked scaled scores, fp32 [b, hq, L] (fp64 for fp64 inputs); it is returned
for the backward and is not differentiable.

The torch backend is blockwise, as FlashAttention-2: query blocks x key blocks, an online
softmax in fp32 (fp64 for fp64), the backward recomputing each block's probabilities from
lse. A GQA group's query heads share one matmul against their KV head (no repeat of K/V).
Blocks the mask leaves empty, or past valid_len, are skipped; temporaries are
O(b * hq * BQ * BK). Block sizes: `$AUTOSP_MASKED_BLOCK` ("512" or "256,1024": BQ,BK), else
`DEFAULT_BLOCK`, measured on CPU at L = 4k..16k.

Backends (`_implementation` is the one place that picks): "torch" runs the blockwise path;
"triton" runs flash.py's kernels with the mask as comparison terms (maskterms.py: document ids,
positions, windows, causal, padding; tiles the mask empties are skipped, so packed documents cost
sum(doc_len^2)), on CUDA/ROCm tensors compiled and on CPU tensors in Triton's interpreter (under
TRITON_INTERPRET=1), and raises AutospError naming why when it cannot (a mask not of that form, a
float64 tensor, a head dim over 256); "auto" is "triton" on CUDA/ROCm tensors when it can, else the
blockwise path. `describe` says which runs, for autosp.explain.
"""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import torch

from autosp.errors import AutospError
from autosp.kernels import flash
from autosp.kernels._ops import differentiable
from autosp.kernels._triton import resolve_backend, triton_available
from autosp.kernels.maskfn import check_leaves, mask_block, parse
from autosp.kernels.maskterms import TileMask, leaf_kinds, recognise, why_not

BACKENDS = ("auto", "triton", "torch")
# (BQ, BK). Measured fwd+bwd, b=1, 2 heads, d=64, fp32, causal, 2 CPU threads: L=4096 0.32 / 0.31 /
# 0.39 s at 256 / 512 / 1024; L=16384 4.5 / 3.5 / 6.3 s.
DEFAULT_BLOCK = (512, 512)
_OP = "autosp.masked_attention"


def block_sizes() -> tuple[int, int]:
    """(BQ, BK) from $AUTOSP_MASKED_BLOCK ("512" or "256,1024"), else DEFAULT_BLOCK."""
    env = os.environ.get("AUTOSP_MASKED_BLOCK", "").strip()
    if not env:
        return DEFAULT_BLOCK
    try:
        sizes = [int(x) for x in env.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) not in (1, 2) or min(sizes) < 1:
        raise AutospError(f"{_OP}: AUTOSP_MASKED_BLOCK={env!r} must be one positive int or two (BQ,BK), "
                          f"as 512 or 256,1024")
    return (sizes[0], sizes[-1])


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _shapes(q, k, v, leaves=()) -> str:
    text = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if leaves:
        text += ", leaves " + ", ".join(str(tuple(t.shape)) if isinstance(t, torch.Tensor) else "?" for t in leaves)
    return text


_CHECKED: set = set()     # signatures already checked: a training step calls with the same few


def check_inputs(q, k, v, leaves, mask, scale, valid_len, backend) -> None:
    """Raise AutospError naming the shapes and the fix for anything the op does not take.
    Reads shapes, dtypes and devices only; a signature is checked once per process."""
    try:
        sig = (tuple((tuple(t.shape), t.dtype, t.device) for t in (q, k, v, *leaves)), len(leaves),
               mask, type(scale), scale, type(valid_len), valid_len, backend)
        if sig in _CHECKED:
            return
    except (AttributeError, TypeError):      # not tensors, or unhashable: the checks below say what
        sig = None
    _check_inputs(q, k, v, leaves, mask, scale, valid_len, backend)
    if sig is not None:
        if len(_CHECKED) > 4096:
            _CHECKED.clear()
        _CHECKED.add(sig)


def _check_inputs(q, k, v, leaves, mask, scale, valid_len, backend) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise AutospError(f"{_OP}: {name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise AutospError(f"{_OP}: {_shapes(q, k, v)}: {name} must be 4-D [batch, heads, seq, head_dim]; "
                              f"for [batch, seq, heads, head_dim] inputs pass {name}.transpose(1, 2)")
    b, hq, s, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        raise AutospError(f"{_OP}: {_shapes(q, k, v)}: k and v must be [b, hkv, L, d] with q's b, L and d; "
                          f"pad or slice them to one sequence length")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise AutospError(f"{_OP}: {_shapes(q, k, v)}: query heads ({hq}) must be a multiple of key/value "
                          f"heads ({hkv}) for grouped-query attention; repeat k/v heads to a divisor of {hq}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise AutospError(f"{_OP}: {_shapes(q, k, v)}: dtypes {q.dtype}, {k.dtype}, {v.dtype}: q, k, v must "
                          f"share one floating dtype; cast them with .to(q.dtype)")
    if not (q.device == k.device == v.device):
        raise AutospError(f"{_OP}: {_shapes(q, k, v)}: devices {q.device}, {k.device}, {v.device}: move q, k, v "
                          f"to one device")
    if not isinstance(leaves, (list, tuple)):
        raise AutospError(f"{_OP}: leaves must be a list of tensors, got {type(leaves).__name__}")
    check_leaves(mask, leaves, s, b, q.device, op=f"{_OP}: {_shapes(q, k, v, leaves)}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise AutospError(f"{_OP}: scale must be None or a finite float, got {scale!r}")
    if isinstance(valid_len, bool) or not isinstance(valid_len, int) or not 0 <= valid_len <= s:
        raise AutospError(f"{_OP}: {_shapes(q, k, v)}: valid_len {valid_len!r} must be an int in [0, {s}] (keys "
                          f"at and past it are padding); pass None or {s} for no padding")
    if backend not in BACKENDS:
        raise AutospError(f"{_OP}: backend {backend!r} unknown; use one of {BACKENDS}")


# ---------------------------------------------------------------- the blockwise torch path


def _rows(t: torch.Tensor, hkv: int, dtype: torch.dtype) -> torch.Tensor:
    # [b, hq, L, d] -> [b*hkv, L*g, d]: row l*g + j is query l of head (kv head)*g + j, so a
    # block of queries of a whole GQA group is one contiguous bmm operand.
    b, hq, s, d = t.shape
    g = hq // hkv
    return t.to(dtype).reshape(b, hkv, g, s, d).transpose(2, 3).reshape(b * hkv, s * g, d)


def _unrows(t: torch.Tensor, b: int, hq: int, dtype: torch.dtype) -> torch.Tensor:
    # [b*hkv, L*g, ...] -> [b, hq, L, ...], contiguous: the inverse of _rows.
    bh, sg = t.shape[:2]
    g = hq // (bh // b)
    tail = t.shape[2:]
    out = t.reshape(b, bh // b, sg // g, g, *tail).transpose(2, 3).reshape(b, hq, sg // g, *tail)
    return out.to(dtype).contiguous()


def _block_mask(fn, leaves, i0, i1, j0, j1, device):
    """The mask on a block: False when it lets nothing through (skip the block), None when it
    lets everything through and adds nothing, else the tensor, broadcastable to [B or 1, n, m].
    (count_nonzero on the unexpanded mask: several times faster than any() and all() on CPU.)"""
    m = mask_block(fn, leaves, i0, i1, j0, j1, device, expand=False)
    if m.dtype == torch.bool:
        kept = int(m.count_nonzero())
        return False if kept == 0 else None if kept == m.numel() else m
    if int(torch.isneginf(m).count_nonzero()) == m.numel():
        return False
    return m if int(m.count_nonzero()) else None


def _masked_scores(qi, kj, mask, b, g, shift=None):
    """Scaled scores of a block, [b*hkv, n*g, m], minus `shift` [b*hkv, n*g, 1] if given (one
    pass fewer than subtracting after), with the mask applied (qi holds q * scale)."""
    if shift is None:
        s = torch.bmm(qi, kj.transpose(1, 2))
    else:
        s = torch.baddbmm(shift.neg(), qi, kj.transpose(1, 2))
    if mask is not None:
        bh, ng, m = s.shape
        s5 = s.view(b, bh // b, ng // g, g, m)
        mk = mask[:, None, :, None, :]                    # [B or 1, 1, n, 1, m]: over kv heads and group
        if mask.dtype == torch.bool:
            s5.masked_fill_(~mk, float("-inf"))
        else:
            s5.add_(mk.to(s.dtype))
    return s


def _blocked(q, k, v, mask, scale: float, block):
    """What both directions start from: the parsed mask, the GQA group size, the compute dtype, the
    block sizes, q * scale as GQA rows [bh, L*g, d], and k, v as [bh, L, d]."""
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    ct = _compute_dtype(q.dtype)
    kv = [t.to(ct).reshape(b * hkv, s, d) for t in (k, v)]
    return parse(mask), hq // hkv, ct, block or block_sizes(), _rows(q, hkv, ct) * scale, *kv


def torch_forward(q, k, v, leaves, mask, scale: float, valid_len: int,
                  block: Optional[tuple[int, int]] = None):
    """(out, lse) by blocks; see the module docstring."""
    fn, g, ct, (bq, bk), qr, kr, vr = _blocked(q, k, v, mask, scale, block)
    b, hq, s, _ = q.shape
    out = torch.empty_like(qr)
    lse = torch.empty(qr.shape[:2], dtype=ct, device=q.device)   # [bh, L*g]; every row block writes both
    for i0 in range(0, s, bq):
        i1 = min(s, i0 + bq)
        qi = qr[:, i0 * g:i1 * g]                          # [bh, n*g, d]
        row_max = torch.full(qi.shape[:2], float("-inf"), dtype=ct, device=q.device)
        row_sum = torch.zeros(qi.shape[:2], dtype=ct, device=q.device)
        acc = torch.zeros_like(qi)
        for j0 in range(0, valid_len, bk):
            j1 = min(valid_len, j0 + bk)
            mk = _block_mask(fn, leaves, i0, i1, j0, j1, q.device)
            if mk is False:
                continue
            p = _masked_scores(qi, kr[:, j0:j1], mk, b, g)  # [bh, n*g, m]
            new_max = torch.maximum(row_max, p.amax(-1))
            shift = new_max.masked_fill(new_max == float("-inf"), 0.0)   # rows with nothing yet
            p.sub_(shift[..., None]).exp_()
            alpha = (row_max - shift).exp_()
            row_sum.mul_(alpha).add_(p.sum(-1))
            acc.mul_(alpha[..., None]).baddbmm_(p, vr[:, j0:j1])
            row_max = new_max
        out[:, i0 * g:i1 * g] = acc / row_sum.masked_fill(row_sum == 0, 1.0)[..., None]
        lse[:, i0 * g:i1 * g] = row_max + row_sum.log()   # -inf where the row attends nothing
    return _unrows(out, b, hq, q.dtype), _unrows(lse, b, hq, ct)


def torch_backward(dout, q, k, v, out, lse, leaves, mask, scale: float, valid_len: int,
                   block: Optional[tuple[int, int]] = None):
    """(dq, dk, dv) by blocks, FlashAttention-2's backward: P recomputed from lse,
    delta = rowsum(dO * O), dS = P * (dO V^T - delta)."""
    fn, g, ct, (bq, bk), qr, kr, vr = _blocked(q, k, v, mask, scale, block)
    b, hq, s, _ = q.shape
    hkv = k.shape[1]
    dor = _rows(dout, hkv, ct)
    delta = (dor * _rows(out, hkv, ct)).sum(-1)                        # [bh, L*g]
    lser = _rows(lse[..., None], hkv, ct)[..., 0]
    lser = lser.masked_fill(lser == float("-inf"), 0.0)   # empty rows: all scores -inf, so P = 0
    dq = torch.zeros_like(qr)
    dk = torch.zeros_like(kr)
    dv = torch.zeros_like(vr)
    for i0 in range(0, s, bq):
        i1 = min(s, i0 + bq)
        rows = slice(i0 * g, i1 * g)
        qi, doi = qr[:, rows], dor[:, rows]
        lse_i, neg_delta_i = lser[:, rows, None], delta[:, rows, None].neg()
        dqi = torch.zeros_like(qi)
        for j0 in range(0, valid_len, bk):
            j1 = min(valid_len, j0 + bk)
            mk = _block_mask(fn, leaves, i0, i1, j0, j1, q.device)
            if mk is False:
                continue
            kj, vj = kr[:, j0:j1], vr[:, j0:j1]
            p = _masked_scores(qi, kj, mk, b, g, shift=lse_i).exp_()    # [bh, n*g, m]
            dv[:, j0:j1] += torch.bmm(p.transpose(1, 2), doi)
            ds = torch.baddbmm(neg_delta_i, doi, vj.transpose(1, 2)).mul_(p)
            dqi.baddbmm_(ds, kj)
            dk[:, j0:j1] += torch.bmm(ds.transpose(1, 2), qi)   # qi is q * scale: dK = dS^T Q scale
        dq[:, rows] = dqi.mul_(scale)
    return (_unrows(dq, b, hq, q.dtype), dk.reshape(k.shape).to(k.dtype).contiguous(),
            dv.reshape(v.shape).to(v.dtype).contiguous())


# ---------------------------------------------------------------- backend choice


def triton_forward(q, k, v, leaves, mask, scale: float, valid_len: int):
    """(out, lse) by flash.py's kernels under the mask's terms (the mask must be recognised)."""
    terms = recognise(mask)
    tiles = TileMask.build(terms, leaves, q.shape[2], valid_len, q.device)
    return flash._triton_forward(q, k, v, terms.causal, scale, tiles)


def triton_backward(dout, q, k, v, out, lse, leaves, mask, scale: float, valid_len: int):
    terms = recognise(mask)
    tiles = TileMask.build(terms, leaves, q.shape[2], valid_len, q.device)
    return flash._triton_backward(dout, q, k, v, out, lse, None, terms.causal, scale, tiles)


def _kernel_problem(q: torch.Tensor, leaves, mask) -> Optional[str]:
    """Why the Triton kernels cannot take these inputs, ending with the fix; None if they can."""
    why = flash._kernel_unsupported(q)
    if why is None:
        why = why_not(mask, leaf_kinds(leaves))
        if why is not None:
            why += "; use backend='auto' or 'torch' (the blockwise path)"
    return why


def _implementation(q: torch.Tensor, leaves, mask, backend: str):
    """(forward, backward) for these inputs: the one dispatch point (module docstring)."""
    if backend != "torch" and resolve_backend("masked_attention", backend, q,
                                              _kernel_problem(q, leaves, mask)) == "triton":
        return triton_forward, triton_backward
    return torch_forward, torch_backward


def describe(mask, device, leaves: Optional[Sequence] = None) -> str:
    """Which path runs masked_attention with this mask on `device` under backend "auto", in one
    phrase for autosp.explain. `leaves`: tensors (or anything with a .dtype) to check the kinds of;
    the inputs' dtype and head dim are not known here (the kernels take fp16/bf16/fp32, d <= 256)."""
    device = torch.device(device)
    why = why_not(mask, None if leaves is None else leaf_kinds(leaves))
    if device.type == "cuda" and why is None and triton_available():
        return (f"Triton flash kernel on the terms {recognise(mask)}: tiles the mask empties are skipped "
                f"(packed documents cost sum(doc_len^2), not s^2)")
    text = "blockwise torch (query x key blocks, fully masked blocks skipped)"
    if device.type == "cuda":
        text += f"; not the Triton kernel: {why or 'triton is not installed'}"
    return text


def _resolve_scale(scale: Optional[float], d: int) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(d)


def _empty_outputs(q):
    b, hq, s, d = q.shape
    return q.new_empty((b, hq, s, d)), q.new_empty((b, hq, s), dtype=_compute_dtype(q.dtype))


# ---------------------------------------------------------------- the custom ops


@torch.library.custom_op("autosp::masked_attention", mutates_args=())
def masked_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list[torch.Tensor], mask: str,
                        scale: Optional[float], valid_len: int,
                        backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs(q, k, v, leaves, mask, scale, valid_len, backend)
    forward, _ = _implementation(q, leaves, mask, backend)
    if q.numel() == 0:
        out, lse = _empty_outputs(q)
        return out.zero_(), lse.fill_(float("-inf"))
    return forward(q, k, v, leaves, mask, _resolve_scale(scale, q.shape[-1]), valid_len)


@masked_attention_op.register_fake
def _masked_attention_fake(q, k, v, leaves, mask, scale, valid_len, backend):
    check_inputs(q, k, v, leaves, mask, scale, valid_len, backend)
    return _empty_outputs(q)


@torch.library.custom_op("autosp::masked_attention_backward", mutates_args=())
def masked_attention_backward_op(
        dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        leaves: list[torch.Tensor], mask: str, scale: Optional[float], valid_len: int,
        backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_inputs(q, k, v, leaves, mask, scale, valid_len, backend)
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != q.shape[:3]:
        raise AutospError(f"autosp.masked_attention_backward: {_shapes(q, k, v)}, dout {tuple(dout.shape)}, out "
                          f"{tuple(out.shape)}, lse {tuple(lse.shape)}: dout and out must be q's shape and lse "
                          f"[b, hq, L]; pass the forward's outputs unchanged")
    _, backward = _implementation(q, leaves, mask, backend)
    if q.numel() == 0:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    return backward(dout, q, k, v, out, lse, leaves, mask, _resolve_scale(scale, q.shape[-1]), valid_len)


@masked_attention_backward_op.register_fake
def _masked_attention_backward_fake(dout, q, k, v, out, lse, leaves, mask, scale, valid_len, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, leaves, mask, scale, valid_len, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *leaves)
    ctx.mask, ctx.scale, ctx.valid_len, ctx.backend = mask, scale, valid_len, backend
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, *leaves = ctx.saved_tensors
    no_leaves = [None] * len(leaves)              # leaves: ids, positions, constants
    if dout is None:
        return None, None, None, no_leaves, None, None, None, None
    # The backward op has no derivative of its own (no double backward); under no_grad it
    # also skips the autograd layer that torch.func transforms reject.
    with torch.no_grad():
        dq, dk, dv = torch.ops.autosp.masked_attention_backward(dout, q, k, v, out, lse, leaves, ctx.mask,
                                                                ctx.scale, ctx.valid_len, ctx.backend)
    return dq, dk, dv, no_leaves, None, None, None, None


_differentiable_op = differentiable(masked_attention_op, _setup_context, _backward)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str,
                     leaves: Sequence[torch.Tensor] = (), scale: Optional[float] = None,
                     valid_len: Optional[int] = None, backend: str = "auto") -> torch.Tensor:
    """Attention of q [b, hq, L, d] over k, v [b, hkv, L, d] under `mask` (a maskfn expression
    over q, k and `leaves`), keys from `valid_len` on masked; differentiable in q, k, v."""
    leaves = list(leaves)
    if valid_len is None and isinstance(q, torch.Tensor) and q.dim() == 4:
        valid_len = q.shape[2]
    check_inputs(q, k, v, leaves, mask, scale, valid_len, backend)  # errors name this call
    scale = None if scale is None else float(scale)
    return _differentiable_op(q, k, v, leaves, mask, scale, valid_len, backend)[0]


def _register_flop_formulas() -> None:
    """FLOPs for torch.utils.flop_counter: 2 matmuls forward, 5 backward (P recomputed), over all
    L x L pairs. Upper bounds: the kernels skip blocks the mask empties, which a shape-only
    formula cannot see."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    fwd, bwd = torch.ops.autosp.masked_attention, torch.ops.autosp.masked_attention_backward
    if fwd not in flop_registry:
        @register_flop_formula(fwd)
        def _fwd_flops(q_shape, *args, out_shape=None, **kwargs) -> int:
            b, hq, s, d = q_shape
            return 4 * b * hq * d * s * s

    if bwd not in flop_registry:
        @register_flop_formula(bwd)
        def _bwd_flops(dout_shape, q_shape, *args, out_shape=None, **kwargs) -> int:
            b, hq, s, d = q_shape
            return 10 * b * hq * d * s * s


_register_flop_formulas()

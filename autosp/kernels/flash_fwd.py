"""Triton causal flash attention, forward: kernel and host launcher.

One program owns BLOCK_M query rows of one (batch, query head) and streams the
K/V rows of that head's KV group (GQA: query head h reads KV head h // group)
through an online softmax. Everything is pointer arithmetic on the inputs' own
strides (no `tl.make_block_ptr`: gone in Triton 3.9; tensor descriptors are not
in both 3.6 and 3.9 in the same form), so transposed views need no copy.

Why two loops: the tiles strictly left of the diagonal block (causal) or all
full tiles (non-causal) need no mask, so they run without any mask arithmetic;
only the diagonal block and the ragged tail run the masked body. Tiles right of
the diagonal are never visited. This needs BLOCK_M % BLOCK_N == 0 (config.py).

Numerics: scores are scaled by scale*log2(e) inside the exponent's FMA, so the softmax is exp2; the
running max, sum and the output accumulate in fp32; P is cast to the input
dtype for the P@V dot (fp32 inputs use IEEE dots, never TF32). LSE is stored in
natural-log units, like SDPA's logsumexp, fp32 [b, hq, s].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from autosp.kernels._tl import row_max, row_sum, tile_offsets, tile_offsets_t
from autosp.kernels._triton import check_grid, jit, launch_device

LOG2E = 1.4426950408889634


@jit
def _fwd_tiles(acc, l_i, m_i, q, k_base, v_base,
               stride_kn, stride_kd, stride_vn, stride_vd,
               offs_m, offs_d, lo, hi, seq_len, qk_scale,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr):
    # acc [BLOCK_M, D] fp32, l_i / m_i [BLOCK_M] fp32 (m_i in log2 units), q [BLOCK_M, D].
    # K/V rows lo..hi of this head; MASKED adds the tail (and, if CAUSAL, the diagonal) mask.
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        kt_ptrs = k_base + tile_offsets_t(start_n, stride_kn, offs_d, stride_kd, BLOCK_N)  # (D, BLOCK_N)
        v_ptrs = v_base + tile_offsets(start_n, stride_vn, offs_d, stride_vd, BLOCK_N)  # (BLOCK_N, D)
        if MASKED:
            kt = tl.load(kt_ptrs, mask=offs_n[None, :] < seq_len, other=0.0)
            v = tl.load(v_ptrs, mask=offs_n[:, None] < seq_len, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
        qk = tl.dot(q, kt, input_precision=DOT_PREC)
        if MASKED:
            keep = offs_n[None, :] < seq_len
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            # Every row meets a kept column in its first tile (column 0 or its own
            # diagonal), so m_i is finite before a fully masked row-tile can occur.
            qk = tl.where(keep, qk, float("-inf"))
        # the scale rides on the row max (qk_scale > 0), so each score costs one FMA before exp2
        m_new = tl.maximum(m_i, row_max(qk) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + row_sum(p)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@jit
def _attn_fwd(Q, K, V, O, LSE,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              n_heads_q, group, seq_len, qk_scale,
              HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr):
    # grid: (b * hq, cdiv(seq_len, BLOCK_M)). Offsets in int64 (batch, head, the tile's first row):
    # b*h*s*d and s*stride_qm pass 2**31 (_tl.tile_offsets).
    # Heads are the fast grid axis and query tiles run last-first: under a causal mask the last
    # tiles have the most work, so every head's heaviest tile starts in the first wave and the
    # short ones fill the tail.
    start_m = tl.num_programs(1) - 1 - tl.program_id(1)
    off_bh = tl.program_id(0)
    off_b = (off_bh // n_heads_q).to(tl.int64)
    off_h = off_bh % n_heads_q
    off_hk = (off_h // group).to(tl.int64)
    off_h = off_h.to(tl.int64)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    row_ok = offs_m < seq_len
    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + tile_offsets(start_m * BLOCK_M, stride_qm, offs_d, stride_qd,
                                                                      BLOCK_M)
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_D], 0.0, dtype=tl.float32)

    if CAUSAL:
        full_hi = start_m * BLOCK_M  # tiles left of the diagonal block: all in bounds
        masked_hi = tl.minimum(full_hi + BLOCK_M, seq_len)
    else:
        full_hi = (seq_len // BLOCK_N) * BLOCK_N
        masked_hi = seq_len
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_m, offs_d, 0, full_hi, seq_len, qk_scale,
                               BLOCK_N, False, CAUSAL, DOT_PREC)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_m, offs_d, full_hi, masked_hi, seq_len, qk_scale,
                               BLOCK_N, True, CAUSAL, DOT_PREC)

    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # back to natural-log units
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh + tile_offsets(start_m * BLOCK_M, stride_om, offs_d, stride_od,
                                                                      BLOCK_M)
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + off_bh.to(tl.int64) * seq_len + offs_m, lse, mask=row_ok)


def dot_precision(dtype: torch.dtype):
    """fp32 inputs get IEEE dots (TF32 would miss the 1e-5 contract); 16-bit: the default."""
    return "ieee" if dtype == torch.float32 else None


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                      cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward. q [b, hq, s, d], k/v [b, hkv, s, d], any strides, d a power of two
    in [16, 256] (flash_attention.py pads other head dims). Returns o [b, hq, s, d]
    contiguous and lse fp32 [b, hq, s]."""
    b, hq, s, d = q.shape
    o = torch.empty((b, hq, s, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, s), dtype=torch.float32, device=q.device)
    with launch_device(q):
        grid = check_grid((b * hq, triton.cdiv(s, cfg["BLOCK_M"])), f"flash attention forward at s={s}")
        _attn_fwd[grid](
            q, k, v, o, lse,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(),
            hq, hq // k.shape[1], s, scale * LOG2E,
            HEAD_D=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal,
            DOT_PREC=dot_precision(q.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return o, lse

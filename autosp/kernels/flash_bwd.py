"""Triton causal flash attention, backward: kernels and host launcher.

Three programs, as in FlashAttention-2:
  1. preprocess: delta = rowsum(O * dO) (minus dLSE when the LSE output has a
     gradient: d lse / d S = P, so it folds into the same term), fp32 [b, hq, s];
  2. dK/dV, KV-stationary: one program owns BLOCK_N1 key rows of one KV head and
     loops over the query heads of its GQA group and their query tiles, so every
     dK/dV row has exactly one writer: no atomics, deterministic;
  3. dQ, Q-stationary: one program owns BLOCK_M2 query rows of one query head and
     streams the K/V rows of its KV head.
P is recomputed from the saved LSE (no second online softmax). As in the
forward, unmasked tiles run without mask arithmetic; only the diagonal block and
the ragged tail are masked, and tiles above the diagonal are skipped. Tiling
needs BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0 (config.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from autosp.kernels._tl import row_sum, tile_offsets, tile_offsets_t
from autosp.kernels._triton import check_grid, jit, launch_device
from autosp.kernels.flash_fwd import LOG2E, dot_precision


@jit
def _bwd_preprocess(O, DO, DLSE, Delta,
                    stride_ob, stride_oh, stride_om, stride_od,
                    stride_dob, stride_doh, stride_dom, stride_dod,
                    n_heads_q, seq_len,
                    HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr):
    # grid: (cdiv(seq_len, BLOCK_M), b * hq); DLSE/Delta are contiguous fp32 [b, hq, s].
    off_bh = tl.program_id(1)
    off_b = (off_bh // n_heads_q).to(tl.int64)
    off_h = (off_bh % n_heads_q).to(tl.int64)
    start_m = tl.program_id(0) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    row_ok = offs_m < seq_len
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + tile_offsets(start_m, stride_om, offs_d, stride_od, BLOCK_M),
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh
                 + tile_offsets(start_m, stride_dom, offs_d, stride_dod, BLOCK_M), mask=row_ok[:, None], other=0.0)
    delta = row_sum(o.to(tl.float32) * do.to(tl.float32))
    row = off_bh.to(tl.int64) * seq_len + offs_m
    if HAS_DLSE:
        delta = delta - tl.load(DLSE + row, mask=row_ok, other=0.0)
    tl.store(Delta + row, delta, mask=row_ok)


@jit
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                stride_qm, stride_qd, stride_dom, stride_dod,
                offs_n, offs_d, lo, hi, seq_len, qk_scale,
                BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr):
    # dk/dv [BLOCK_N, D] fp32 accumulators of key rows offs_n; k/v [BLOCK_N, D].
    # Query rows lo..hi of one query head; everything here is transposed (keys x queries).
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        qt_ptrs = q_base + tile_offsets_t(start_m, stride_qm, offs_d, stride_qd, BLOCK_M)  # (D, BLOCK_M)
        do_ptrs = do_base + tile_offsets(start_m, stride_dom, offs_d, stride_dod, BLOCK_M)  # (BLOCK_M, D)
        if MASKED:
            row_ok = offs_m < seq_len
            qt = tl.load(qt_ptrs, mask=row_ok[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        else:
            qt = tl.load(qt_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        qkt = tl.dot(k, qt, input_precision=DOT_PREC) * qk_scale  # (BLOCK_N, BLOCK_M), log2 units
        pt = tl.math.exp2(qkt - lse[None, :] * 1.4426950408889634)
        if MASKED:
            keep = offs_m[None, :] < seq_len
            if CAUSAL:
                keep = keep & (offs_m[None, :] >= offs_n[:, None])
            pt = tl.where(keep, pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PREC)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=DOT_PREC)
    return dk, dv


@jit
def _bwd_dkdv(Q, K, V, DO, DK, DV, LSE, Delta,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_dob, stride_doh, stride_dom, stride_dod,
              stride_dkb, stride_dkh, stride_dkn, stride_dkd,
              stride_dvb, stride_dvh, stride_dvn, stride_dvd,
              n_heads_q, n_heads_kv, group, seq_len, qk_scale, sm_scale,
              HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr):
    # grid: (b * hkv, cdiv(seq_len, BLOCK_N)): heads the fast axis; under a causal mask the first key
    # tiles see the most query tiles, so every head's heaviest tile starts in the first wave
    start_n = tl.program_id(1) * BLOCK_N
    off_bhk = tl.program_id(0)
    off_b = (off_bhk // n_heads_kv).to(tl.int64)
    off_hk = (off_bhk % n_heads_kv).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    col_ok = offs_n < seq_len
    k = tl.load(K + off_b * stride_kb + off_hk * stride_kh + tile_offsets(start_n, stride_kn, offs_d, stride_kd, BLOCK_N),
                mask=col_ok[:, None], other=0.0)
    v = tl.load(V + off_b * stride_vb + off_hk * stride_vh + tile_offsets(start_n, stride_vn, offs_d, stride_vd, BLOCK_N),
                mask=col_ok[:, None], other=0.0)
    dk = tl.full([BLOCK_N, HEAD_D], 0.0, dtype=tl.float32)
    dv = tl.full([BLOCK_N, HEAD_D], 0.0, dtype=tl.float32)

    # Query tiles: [diag_lo, full_lo) the masked diagonal block (causal only),
    # [full_lo, full_hi) unmasked, [tail_lo, seq_len) the masked ragged tail.
    full_hi = (seq_len // BLOCK_M) * BLOCK_M
    if CAUSAL:
        full_lo = start_n + BLOCK_N
        diag_hi = tl.minimum(full_lo, seq_len)
    else:
        full_lo = 0
        diag_hi = 0
    tail_lo = tl.maximum(full_lo, full_hi)
    for g in range(0, group):
        off_h = off_hk * group + g
        row0 = (off_b * n_heads_q + off_h) * seq_len
        q_base = Q + off_b * stride_qb + off_h * stride_qh
        do_base = DO + off_b * stride_dob + off_h * stride_doh
        if CAUSAL:
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE + row0, Delta + row0,
                                 stride_qm, stride_qd, stride_dom, stride_dod,
                                 offs_n, offs_d, start_n, diag_hi, seq_len, qk_scale,
                                 BLOCK_M, True, CAUSAL, DOT_PREC)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE + row0, Delta + row0,
                             stride_qm, stride_qd, stride_dom, stride_dod,
                             offs_n, offs_d, full_lo, full_hi, seq_len, qk_scale,
                             BLOCK_M, False, CAUSAL, DOT_PREC)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE + row0, Delta + row0,
                             stride_qm, stride_qd, stride_dom, stride_dod,
                             offs_n, offs_d, tail_lo, seq_len, seq_len, qk_scale,
                             BLOCK_M, True, CAUSAL, DOT_PREC)

    dk = dk * sm_scale
    tl.store(DK + off_b * stride_dkb + off_hk * stride_dkh + tile_offsets(start_n, stride_dkn, offs_d, stride_dkd, BLOCK_N),
             dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + off_b * stride_dvb + off_hk * stride_dvh + tile_offsets(start_n, stride_dvn, offs_d, stride_dvd, BLOCK_N),
             dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@jit
def _dq_tiles(dq, q, do, lse, delta, k_base, v_base,
              stride_kn, stride_kd, stride_vn, stride_vd,
              offs_m, offs_d, lo, hi, seq_len, qk_scale,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr):
    # dq [BLOCK_M, D] fp32 accumulator of query rows offs_m; key rows lo..hi.
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        kt_ptrs = k_base + tile_offsets_t(start_n, stride_kn, offs_d, stride_kd, BLOCK_N)  # (D, BLOCK_N)
        vt_ptrs = v_base + tile_offsets_t(start_n, stride_vn, offs_d, stride_vd, BLOCK_N)  # (D, BLOCK_N)
        if MASKED:
            kt = tl.load(kt_ptrs, mask=offs_n[None, :] < seq_len, other=0.0)
            vt = tl.load(vt_ptrs, mask=offs_n[None, :] < seq_len, other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            vt = tl.load(vt_ptrs)
        qk = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale
        p = tl.math.exp2(qk - lse[:, None])
        if MASKED:
            keep = offs_n[None, :] < seq_len
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, vt, input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=DOT_PREC)
    return dq


@jit
def _bwd_dq(Q, K, V, DO, DQ, LSE, Delta,
            stride_qb, stride_qh, stride_qm, stride_qd,
            stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd,
            stride_dob, stride_doh, stride_dom, stride_dod,
            stride_dqb, stride_dqh, stride_dqm, stride_dqd,
            n_heads_q, group, seq_len, qk_scale, sm_scale,
            HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr):
    # grid: (b * hq, cdiv(seq_len, BLOCK_M)); every head's last (heaviest, if causal) tile first,
    # as in the forward
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    off_bh = tl.program_id(0)
    off_b = (off_bh // n_heads_q).to(tl.int64)
    off_h = off_bh % n_heads_q
    off_hk = (off_h // group).to(tl.int64)
    off_h = off_h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    row_ok = offs_m < seq_len
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + tile_offsets(start_m, stride_qm, offs_d, stride_qd, BLOCK_M),
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh
                 + tile_offsets(start_m, stride_dom, offs_d, stride_dod, BLOCK_M), mask=row_ok[:, None], other=0.0)
    row = off_bh.to(tl.int64) * seq_len + offs_m
    lse = tl.load(LSE + row, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(Delta + row, mask=row_ok, other=0.0)
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    dq = tl.full([BLOCK_M, HEAD_D], 0.0, dtype=tl.float32)

    if CAUSAL:
        full_hi = start_m
        masked_hi = tl.minimum(start_m + BLOCK_M, seq_len)
    else:
        full_hi = (seq_len // BLOCK_N) * BLOCK_N
        masked_hi = seq_len
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, offs_d, 0, full_hi, seq_len, qk_scale, BLOCK_N, False, CAUSAL, DOT_PREC)
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, offs_d, full_hi, masked_hi, seq_len, qk_scale, BLOCK_N, True, CAUSAL, DOT_PREC)
    dq = dq * sm_scale
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + tile_offsets(start_m, stride_dqm, offs_d, stride_dqd, BLOCK_M),
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


def attention_backward(do, q, k, v, o, lse, dlse, causal: bool, scale: float, cfg: dict):
    """Launch the backward. Shapes as in `attention_forward`; lse fp32 [b, hq, s] from it;
    dlse None or [b, hq, s]. Returns dq [b, hq, s, d], dk, dv [b, hkv, s, d], contiguous."""
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    lse = lse.contiguous()
    delta = torch.empty((b, hq, s), dtype=torch.float32, device=q.device)
    dlse = None if dlse is None else dlse.to(torch.float32).contiguous()
    with launch_device(q):
        pre_block = 64
        _bwd_preprocess[(triton.cdiv(s, pre_block), b * hq)](
            o, do, delta if dlse is None else dlse, delta, *o.stride(), *do.stride(), hq, s,
            HEAD_D=d, BLOCK_M=pre_block, HAS_DLSE=dlse is not None, num_warps=4,
        )
        dq = torch.empty((b, hq, s, d), dtype=q.dtype, device=q.device)
        dk = torch.empty((b, hkv, s, d), dtype=k.dtype, device=k.device)
        dv = torch.empty((b, hkv, s, d), dtype=v.dtype, device=v.device)
        common = dict(HEAD_D=d, CAUSAL=causal, DOT_PREC=dot_precision(q.dtype),
                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        _bwd_dkdv[check_grid((b * hkv, triton.cdiv(s, cfg["BLOCK_N1"])), f"flash attention dK/dV at s={s}")](
            q, k, v, do, dk, dv, lse, delta,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
            hq, hkv, group, s, scale * LOG2E, scale,
            BLOCK_M=cfg["BLOCK_M1"], BLOCK_N=cfg["BLOCK_N1"], **common,
        )
        _bwd_dq[check_grid((b * hq, triton.cdiv(s, cfg["BLOCK_M2"])), f"flash attention dQ at s={s}")](
            q, k, v, do, dq, lse, delta,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
            hq, group, s, scale * LOG2E, scale,
            BLOCK_M=cfg["BLOCK_M2"], BLOCK_N=cfg["BLOCK_N2"], **common,
        )
    return dq, dk, dv

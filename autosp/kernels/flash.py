"""Causal flash attention: Triton kernels (forward, backward), launchers, the custom ops, autograd.

    out = flash_attention(q, k, v, causal=True, scale=None, backend="auto")
    out, lse = flash_attention_with_lse(q, k, v, causal, scale, backend)   # both differentiable

q [b, hq, s, d]; k, v [b, hkv, s, d] with hq % hkv == 0 (GQA: query head h attends
with KV head h // (hq // hkv), as SDPA's enable_gqa). lse is the natural-log
logsumexp of the scaled scores, fp32 [b, hq, s] (fp64 for fp64 inputs). Both outputs
are contiguous, in the real and the fake implementation.

The ops. `autosp::flash_attention` -> (out, lse) and `autosp::flash_attention_backward`
-> (dq, dk, dv) are torch.library custom ops with fakes, so tracing (make_fx over fake
tensors), the IR and remat see one attention op whose saved state is exactly (q, k, v,
out, lse), and one backward op. Autograd: `_ops.differentiable` (one setup_context /
backward pair, given to the op and to the wrappers' autograd.Function: the reasons are
in _ops.py). Backends (_triton.resolve_backend): "triton" runs the kernels below
(compiled on GPU tensors; on CPU tensors in Triton's interpreter, under
TRITON_INTERPRET=1); "torch" runs SDPA's own kernels or exact math (flash_torch.py);
"auto" is Triton on CUDA/ROCm tensors when the shape and dtype allow it. Head dims that
are not a power of two in [16, 256] are zero-padded for Triton (zeros change neither
the scores nor the kept columns).

The kernels load on the first Triton call (_triton.jit_module: this module imports
without triton). Tiles move one of two ways, chosen per launch by the config's TMA key
(config.py: on for Hopper and later): through tensor descriptors made on the host over
the inputs' own [b, h, s, d] strides (the copy engine fetches whole tiles, zero-fills rows
past s and clips stores: no address registers, which is what lets the d=128 kernels run
without spills), or, where a descriptor cannot address a tensor (`tma_problem`: strides
that are not multiples of 16 bytes) and before Hopper, pointer arithmetic on the same
strides with each tile's first row in 64 bits (`tile_offsets`; no `tl.make_block_ptr`:
gone in Triton 3.9). Either way transposed views need no copy.

Forward: one program owns BLOCK_M query rows of one (batch, query head) and streams the
K/V rows of that head's KV group through an online softmax. Tiles strictly left of the
diagonal block (causal) or all full tiles (non-causal) run without mask arithmetic;
only the diagonal block and the ragged tail run the masked body; tiles right of the
diagonal are never visited (needs BLOCK_M % BLOCK_N == 0, config.py). Scores are scaled
by scale*log2(e) inside the exponent's FMA, so the softmax is exp2; the running max, sum
and output accumulate in fp32; P is cast to the input dtype for the P@V dot (fp32 inputs
use IEEE dots, never TF32).

Backward, three programs as in FlashAttention-2:
  1. preprocess: delta = rowsum(O * dO) (minus dLSE when the LSE output has a gradient:
     d lse / d S = P, so it folds into the same term), fp32 [b, hq, s];
  2. dK/dV, KV-stationary: one program owns BLOCK_N1 key rows of one KV head and loops
     over the query heads of its GQA group and their query tiles, so every dK/dV row has
     exactly one writer: no atomics, deterministic;
  3. dQ, Q-stationary: one program owns BLOCK_M2 query rows of one query head and streams
     the K/V rows of its KV head.
P is recomputed from the saved LSE (turned into log2 units once, by the preprocess, so each
score is one FMA before exp2). Masking as in the forward (needs BLOCK_N1 % BLOCK_M1
== 0 and BLOCK_M2 % BLOCK_N2 == 0).

Masks as terms (masked_attention's Triton path): with N_TERMS > 0 the same three kernels take a
mask that is a conjunction of comparisons between a per-query and a per-key int vector
(maskterms.py: document ids, positions, windows, causal, key padding) and a key length kv_len,
skip the tiles the mask empties and mask only the tiles it cuts; rows it empties get out 0,
lse -inf and zero gradients. The section "masks as comparison terms" below says how. With
N_TERMS == 0 that code is compiled out: plain attention's kernels are unchanged.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from autosp.kernels import config
from autosp.kernels._ops import differentiable, fail
from autosp.kernels._triton import BACKENDS, check_grid, jit_module, kernel, launch_device, resolve_backend
from autosp.kernels.flash_torch import lse_dtype, torch_backward, torch_forward

LOG2E = 1.4426950408889634
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_TRITON_HEAD_DIM = 256
tl = None  # triton.language: bound, and the @kernel functions jitted, by load_kernels()


# ---------------------------------------------------------------- kernels: 64-bit tile offsets
# A row offset `row * stride_row` passes 2**31 long before the tensor does: a [b, s, h, d] view
# (which flash_attention accepts without a copy) has stride_row = h * d, so s * h * d >= 2**31 at
# 128 heads x 128 at s = 128k. Every kernel takes its tile offsets from these helpers: the tile's
# first row in 64 bits, the rows inside the tile (at most a block times the stride) in 32.


@kernel
def tile_offsets(start, stride_r, offs_c, stride_c, ROWS: tl.constexpr):
    # [ROWS, len(offs_c)] element offsets of rows start .. start + ROWS - 1, columns offs_c
    return tl.cast(start, tl.int64) * stride_r + (tl.arange(0, ROWS)[:, None] * stride_r
                                                  + offs_c[None, :] * stride_c)


@kernel
def tile_offsets_t(start, stride_r, offs_c, stride_c, ROWS: tl.constexpr):
    # the same tile transposed: [len(offs_c), ROWS] (K^T, V^T and Q^T tiles for the dots)
    return tl.cast(start, tl.int64) * stride_r + (tl.arange(0, ROWS)[None, :] * stride_r
                                                  + offs_c[:, None] * stride_c)


@kernel
def _offsets_probe(OUT, OUT_T, start, stride_r, stride_c, ROWS: tl.constexpr, COLS: tl.constexpr):
    cols = tl.arange(0, COLS)
    tl.store(OUT + tl.arange(0, ROWS)[:, None] * COLS + cols[None, :], tile_offsets(start, stride_r, cols, stride_c, ROWS))
    tl.store(OUT_T + cols[:, None] * ROWS + tl.arange(0, ROWS)[None, :],
             tile_offsets_t(start, stride_r, cols, stride_c, ROWS))


# ---------------------------------------------------------------- kernels: loading and storing tiles
# A tile is ROWS consecutive rows of the [s, d] matrix of one (batch, head). With TMA (a constexpr)
# `src` is a host-made 4-D tensor descriptor of the whole [b, h, s, d] tensor and the copy engine
# moves the tile (rows past s come back 0, stores past s are dropped); without, `src` is the
# matrix's base pointer and the tile goes through the pointer arithmetic above. A TMA tile costs
# no address registers: per-element 64-bit pointers are what spill the pointer path (compile_sm90.py).


@kernel
def _load_rows(src, off_b, off_h, start, stride_r, stride_c, n_rows,
               ROWS: tl.constexpr, COLS: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    # [ROWS, COLS]: rows start.. (zeros at and past n_rows when MASKED)
    if TMA:
        tile = src.load([off_b.to(tl.int32), off_h.to(tl.int32), start, 0]).reshape(ROWS, COLS)
    else:
        ptrs = src + tile_offsets(start, stride_r, tl.arange(0, COLS), stride_c, ROWS)
        if MASKED:
            tile = tl.load(ptrs, mask=(start + tl.arange(0, ROWS))[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@kernel
def _load_rows_t(src, off_b, off_h, start, stride_r, stride_c, n_rows,
                 ROWS: tl.constexpr, COLS: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    # the same tile transposed, [COLS, ROWS] (K^T, V^T and Q^T for the dots)
    if TMA:
        tile = tl.trans(src.load([off_b.to(tl.int32), off_h.to(tl.int32), start, 0]).reshape(ROWS, COLS))
    else:
        ptrs = src + tile_offsets_t(start, stride_r, tl.arange(0, COLS), stride_c, ROWS)
        if MASKED:
            tile = tl.load(ptrs, mask=(start + tl.arange(0, ROWS))[None, :] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@kernel
def _store_rows(dst, off_b, off_h, start, stride_r, stride_c, n_rows, tile,
                ROWS: tl.constexpr, COLS: tl.constexpr, TMA: tl.constexpr):
    # tile [ROWS, COLS] into rows start.. (those before n_rows)
    if TMA:
        dst.store([off_b.to(tl.int32), off_h.to(tl.int32), start, 0], tile.reshape(1, 1, ROWS, COLS))
    else:
        tl.store(dst + tile_offsets(start, stride_r, tl.arange(0, COLS), stride_c, ROWS), tile,
                 mask=(start + tl.arange(0, ROWS))[:, None] < n_rows)


@kernel
def _matrix(T, off_b, off_h, stride_b, stride_h, TMA: tl.constexpr):
    # what _load_rows takes for the matrix of (off_b, off_h): the descriptor itself, or its base pointer
    if TMA:
        src = T
    else:
        src = T + off_b * stride_b + off_h * stride_h
    return src


# ---------------------------------------------------------------- kernels: forward


@kernel
def _fwd_tiles(acc, l_i, m_i, q, k_src, v_src, off_b, off_hk,
               stride_kn, stride_kd, stride_vn, stride_vd,
               offs_m, lo, hi, seq_len, qk_scale,
               HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    # acc [BLOCK_M, D] fp32, l_i / m_i [BLOCK_M] fp32 (m_i in log2 units), q [BLOCK_M, D].
    # K/V rows lo..hi of this head; MASKED adds the tail (and, if CAUSAL, the diagonal) mask.
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        kt = _load_rows_t(k_src, off_b, off_hk, start_n, stride_kn, stride_kd, seq_len, BLOCK_N, HEAD_D, MASKED, TMA)
        v = _load_rows(v_src, off_b, off_hk, start_n, stride_vn, stride_vd, seq_len, BLOCK_N, HEAD_D, MASKED, TMA)
        qk = tl.dot(q, kt, input_precision=DOT_PREC)
        if MASKED:
            keep = offs_n[None, :] < seq_len
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            # Every row meets a kept column in its first tile (column 0 or its own
            # diagonal), so m_i is finite before a fully masked row-tile can occur.
            qk = tl.where(keep, qk, float("-inf"))
        acc, l_i, m_i = _softmax_update(acc, l_i, m_i, qk, v, qk_scale, False, DOT_PREC)
    return acc, l_i, m_i


@kernel
def _softmax_update(acc, l_i, m_i, qk, v, qk_scale, EMPTY_ROWS: tl.constexpr, DOT_PREC: tl.constexpr):
    # One K/V tile into the online softmax; qk [BLOCK_M, BLOCK_N] raw scores, -inf where masked.
    # The scale rides on the row max (qk_scale > 0), so each score costs one FMA before exp2.
    # EMPTY_ROWS: a row may have met no kept key yet (max -inf): shift it by 0, not by -inf (NaN).
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if EMPTY_ROWS:
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        shift = m_new
    p = tl.math.exp2(qk * qk_scale - shift[:, None])
    alpha = tl.math.exp2(m_i - shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, l_i, m_new


@kernel
def _attn_fwd(Q, K, V, O, LSE,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              TV, TB, stride_tvt, stride_tvs, stride_tvb, stride_tbt, stride_tbr, stride_tbb, kv_len,
              n_heads_q, group, seq_len, qk_scale,
              HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, N_TERMS: tl.constexpr, OPS: tl.constexpr,
              TMA: tl.constexpr):
    # grid: (b * hq, cdiv(seq_len, BLOCK_M)). Q, K, V, O: tensor descriptors if TMA, else pointers with
    # the strides after them (the section above). Offsets in int64 (batch, head, the tile's first row):
    # b*h*s*d and s*stride_qm pass 2**31 (tile_offsets). N_TERMS > 0: masked_attention's terms mask
    # (TV, TB, their strides over term, row and batch, and kv_len: the section above); 0: plain
    # causal or full attention, and the mask arguments are unused.
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
    row_ok = offs_m < seq_len
    q = _load_rows(_matrix(Q, off_b, off_h, stride_qb, stride_qh, TMA), off_b, off_h, start_m * BLOCK_M,
                   stride_qm, stride_qd, seq_len, BLOCK_M, HEAD_D, True, TMA)
    k_src = _matrix(K, off_b, off_hk, stride_kb, stride_kh, TMA)
    v_src = _matrix(V, off_b, off_hk, stride_vb, stride_vh, TMA)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_D], 0.0, dtype=tl.float32)

    if N_TERMS > 0:
        tv = TV + off_b * stride_tvb
        tb = TB + off_b * stride_tbb
        n_k = tl.cdiv(kv_len, BLOCK_N)
        if CAUSAL:  # no key past the diagonal is kept: do not even scan there
            n_k = tl.minimum(n_k, tl.cdiv((start_m + 1) * BLOCK_M, BLOCK_N))
        first, end = _tile_range(tb, stride_tbt, stride_tbr, start_m, 0, n_k, True, N_TERMS, OPS)
        acc, l_i, m_i = _fwd_term_tiles(acc, l_i, m_i, q, k_src, v_src, off_b, off_hk,
                                        stride_kn, stride_kd, stride_vn, stride_vd,
                                        offs_m, first * BLOCK_N, end * BLOCK_N, seq_len, kv_len, qk_scale,
                                        tv, tb, stride_tvt, stride_tvs, stride_tbt, stride_tbr, start_m,
                                        HEAD_D, BLOCK_N, N_TERMS, OPS, DOT_PREC, TMA)
    else:
        if CAUSAL:
            full_hi = start_m * BLOCK_M  # tiles left of the diagonal block: all in bounds
            masked_hi = tl.minimum(full_hi + BLOCK_M, seq_len)
        else:
            full_hi = (seq_len // BLOCK_N) * BLOCK_N
            masked_hi = seq_len
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_src, v_src, off_b, off_hk,
                                   stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_m, 0, full_hi, seq_len, qk_scale,
                                   HEAD_D, BLOCK_N, False, CAUSAL, DOT_PREC, TMA)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_src, v_src, off_b, off_hk,
                                   stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_m, full_hi, masked_hi, seq_len, qk_scale,
                                   HEAD_D, BLOCK_N, True, CAUSAL, DOT_PREC, TMA)

    if N_TERMS > 0:  # a row that attends nothing (m_i -inf, l_i 0, acc 0): out 0, lse -inf
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # back to natural-log units
    _store_rows(_matrix(O, off_b, off_h, stride_ob, stride_oh, TMA), off_b, off_h, start_m * BLOCK_M,
                stride_om, stride_od, seq_len, acc.to(q.dtype), BLOCK_M, HEAD_D, TMA)
    tl.store(LSE + off_bh.to(tl.int64) * seq_len + offs_m, lse, mask=row_ok)


# ---------------------------------------------------------------- kernels: backward


@kernel
def _bwd_preprocess(O, DO, DLSE, Delta, LSE, LSE2,
                    stride_ob, stride_oh, stride_om, stride_od,
                    stride_dob, stride_doh, stride_dom, stride_dod,
                    n_heads_q, seq_len,
                    HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr):
    # grid: (cdiv(seq_len, BLOCK_M), b * hq); DLSE, Delta, LSE, LSE2 are contiguous fp32 [b, hq, s].
    # LSE2: the LSE in log2 units for the two gradient kernels, +inf on rows that attend nothing
    # (LSE -inf, masks only), where every recomputed P must be 0.
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
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = off_bh.to(tl.int64) * seq_len + offs_m
    if HAS_DLSE:
        delta = delta - tl.load(DLSE + row, mask=row_ok, other=0.0)
    tl.store(Delta + row, delta, mask=row_ok)
    lse = tl.load(LSE + row, mask=row_ok, other=0.0)
    tl.store(LSE2 + row, tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634), mask=row_ok)


@kernel
def _dkdv_tiles(dk, dv, k, v, q_src, do_src, off_b, off_h, lse_base, delta_base,
                stride_qm, stride_qd, stride_dom, stride_dod,
                offs_n, lo, hi, seq_len, qk_scale,
                HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    # dk/dv [BLOCK_N, D] fp32 accumulators of key rows offs_n; k/v [BLOCK_N, D]. Query rows lo..hi
    # of one query head; everything here is transposed (keys x queries). lse_base: the LSE in log2
    # units (_bwd_preprocess), so a score is one FMA away from exp2 (the scale is not folded into k:
    # rounding a scaled k back to 16 bits would add an error to every score).
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        qt = _load_rows_t(q_src, off_b, off_h, start_m, stride_qm, stride_qd, seq_len, BLOCK_M, HEAD_D, MASKED, TMA)
        do = _load_rows(do_src, off_b, off_h, start_m, stride_dom, stride_dod, seq_len, BLOCK_M, HEAD_D, MASKED, TMA)
        if MASKED:
            row_ok = offs_m < seq_len
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        pt = tl.math.exp2(tl.dot(k, qt, input_precision=DOT_PREC) * qk_scale - lse[None, :])  # (BLOCK_N, BLOCK_M)
        if MASKED:
            keep = offs_m[None, :] < seq_len
            if CAUSAL:
                keep = keep & (offs_m[None, :] >= offs_n[:, None])
            pt = tl.where(keep, pt, 0.0)
        dk, dv = _dkdv_update(dk, dv, pt, v, qt, do, delta, DOT_PREC)
    return dk, dv


@kernel
def _dkdv_update(dk, dv, pt, v, qt, do, delta, DOT_PREC: tl.constexpr):
    # one query tile into dK, dV: pt = P^T [BLOCK_N, BLOCK_M] (0 where masked), qt = Q^T, do = dO
    dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PREC)
    dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    dst = pt * (dpt - delta[None, :])
    dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=DOT_PREC)
    return dk, dv


@kernel
def _bwd_dkdv(Q, K, V, DO, DK, DV, LSE2, Delta,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_dob, stride_doh, stride_dom, stride_dod,
              stride_dkb, stride_dkh, stride_dkn, stride_dkd,
              stride_dvb, stride_dvh, stride_dvn, stride_dvd,
              TV, TB, stride_tvt, stride_tvs, stride_tvb, stride_tbt, stride_tbr, stride_tbb, kv_len,
              n_heads_q, n_heads_kv, group, seq_len, qk_scale, sm_scale,
              HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, N_TERMS: tl.constexpr, OPS: tl.constexpr,
              TMA: tl.constexpr):
    # grid: (b * hkv, cdiv(seq_len, BLOCK_N)): heads the fast axis; under a causal mask the first key
    # tiles see the most query tiles, so every head's heaviest tile starts in the first wave.
    # Q, K, V, DO, DK, DV as the forward's tensors; LSE2 from _bwd_preprocess.
    start_n = tl.program_id(1) * BLOCK_N
    off_bhk = tl.program_id(0)
    off_b = (off_bhk // n_heads_kv).to(tl.int64)
    off_hk = (off_bhk % n_heads_kv).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_rows(_matrix(K, off_b, off_hk, stride_kb, stride_kh, TMA), off_b, off_hk, start_n, stride_kn, stride_kd,
                   seq_len, BLOCK_N, HEAD_D, True, TMA)
    v = _load_rows(_matrix(V, off_b, off_hk, stride_vb, stride_vh, TMA), off_b, off_hk, start_n, stride_vn, stride_vd,
                   seq_len, BLOCK_N, HEAD_D, True, TMA)
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
    if N_TERMS > 0:  # one query range for the whole GQA group: the mask does not depend on the head
        tv = TV + off_b * stride_tvb
        tb = TB + off_b * stride_tbb
        if CAUSAL:  # no query before the diagonal keeps these keys
            q_lo = start_n // BLOCK_M
        else:
            q_lo = 0
        n_q = tl.where(start_n < kv_len, tl.cdiv(seq_len, BLOCK_M), q_lo)  # keys all padding: none
        first, end = _tile_range(tb, stride_tbt, stride_tbr, start_n // BLOCK_N, q_lo, n_q, False, N_TERMS, OPS)
    for g in range(0, group):
        off_h = off_hk * group + g
        row0 = (off_b * n_heads_q + off_h) * seq_len
        q_src = _matrix(Q, off_b, off_h, stride_qb, stride_qh, TMA)
        do_src = _matrix(DO, off_b, off_h, stride_dob, stride_doh, TMA)
        if N_TERMS > 0:
            dk, dv = _dkdv_term_tiles(dk, dv, k, v, q_src, do_src, off_b, off_h, LSE2 + row0, Delta + row0,
                                      stride_qm, stride_qd, stride_dom, stride_dod,
                                      offs_n, first * BLOCK_M, end * BLOCK_M, seq_len, kv_len, qk_scale,
                                      tv, tb, stride_tvt, stride_tvs, stride_tbt, stride_tbr, start_n // BLOCK_N,
                                      start_n + BLOCK_N > kv_len, HEAD_D, BLOCK_M, N_TERMS, OPS, DOT_PREC, TMA)
        else:
            if CAUSAL:
                dk, dv = _dkdv_tiles(dk, dv, k, v, q_src, do_src, off_b, off_h, LSE2 + row0, Delta + row0,
                                     stride_qm, stride_qd, stride_dom, stride_dod,
                                     offs_n, start_n, diag_hi, seq_len, qk_scale,
                                     HEAD_D, BLOCK_M, True, CAUSAL, DOT_PREC, TMA)
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_src, do_src, off_b, off_h, LSE2 + row0, Delta + row0,
                                 stride_qm, stride_qd, stride_dom, stride_dod,
                                 offs_n, full_lo, full_hi, seq_len, qk_scale,
                                 HEAD_D, BLOCK_M, False, CAUSAL, DOT_PREC, TMA)
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_src, do_src, off_b, off_h, LSE2 + row0, Delta + row0,
                                 stride_qm, stride_qd, stride_dom, stride_dod,
                                 offs_n, tail_lo, seq_len, seq_len, qk_scale,
                                 HEAD_D, BLOCK_M, True, CAUSAL, DOT_PREC, TMA)

    dk = dk * sm_scale
    _store_rows(_matrix(DK, off_b, off_hk, stride_dkb, stride_dkh, TMA), off_b, off_hk, start_n, stride_dkn, stride_dkd,
                seq_len, dk.to(k.dtype), BLOCK_N, HEAD_D, TMA)
    _store_rows(_matrix(DV, off_b, off_hk, stride_dvb, stride_dvh, TMA), off_b, off_hk, start_n, stride_dvn, stride_dvd,
                seq_len, dv.to(v.dtype), BLOCK_N, HEAD_D, TMA)


@kernel
def _dq_tiles(dq, q, do, lse, delta, k_src, v_src, off_b, off_hk,
              stride_kn, stride_kd, stride_vn, stride_vd,
              offs_m, lo, hi, seq_len, qk_scale,
              HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    # dq [BLOCK_M, D] fp32 accumulator of query rows offs_m; key rows lo..hi; lse in log2 units.
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        kt = _load_rows_t(k_src, off_b, off_hk, start_n, stride_kn, stride_kd, seq_len, BLOCK_N, HEAD_D, MASKED, TMA)
        vt = _load_rows_t(v_src, off_b, off_hk, start_n, stride_vn, stride_vd, seq_len, BLOCK_N, HEAD_D, MASKED, TMA)
        p = tl.math.exp2(tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale - lse[:, None])
        if MASKED:
            keep = offs_n[None, :] < seq_len
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(keep, p, 0.0)
        dq = _dq_update(dq, p, do, kt, vt, delta, DOT_PREC)
    return dq


@kernel
def _dq_update(dq, p, do, kt, vt, delta, DOT_PREC: tl.constexpr):
    # one key tile into dQ: p [BLOCK_M, BLOCK_N] (0 where masked), kt = K^T, vt = V^T
    dp = tl.dot(do, vt, input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=DOT_PREC)


@kernel
def _bwd_dq(Q, K, V, DO, DQ, LSE2, Delta,
            stride_qb, stride_qh, stride_qm, stride_qd,
            stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd,
            stride_dob, stride_doh, stride_dom, stride_dod,
            stride_dqb, stride_dqh, stride_dqm, stride_dqd,
            TV, TB, stride_tvt, stride_tvs, stride_tvb, stride_tbt, stride_tbr, stride_tbb, kv_len,
            n_heads_q, group, seq_len, qk_scale, sm_scale,
            HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, N_TERMS: tl.constexpr, OPS: tl.constexpr,
            TMA: tl.constexpr):
    # grid: (b * hq, cdiv(seq_len, BLOCK_M)); every head's last (heaviest, if causal) tile first,
    # as in the forward. Tensors as in _bwd_dkdv.
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    off_bh = tl.program_id(0)
    off_b = (off_bh // n_heads_q).to(tl.int64)
    off_h = off_bh % n_heads_q
    off_hk = (off_h // group).to(tl.int64)
    off_h = off_h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < seq_len
    q = _load_rows(_matrix(Q, off_b, off_h, stride_qb, stride_qh, TMA), off_b, off_h, start_m, stride_qm, stride_qd,
                   seq_len, BLOCK_M, HEAD_D, True, TMA)
    do = _load_rows(_matrix(DO, off_b, off_h, stride_dob, stride_doh, TMA), off_b, off_h, start_m, stride_dom,
                    stride_dod, seq_len, BLOCK_M, HEAD_D, True, TMA)
    row = off_bh.to(tl.int64) * seq_len + offs_m
    lse = tl.load(LSE2 + row, mask=row_ok, other=0.0)
    delta = tl.load(Delta + row, mask=row_ok, other=0.0)
    k_src = _matrix(K, off_b, off_hk, stride_kb, stride_kh, TMA)
    v_src = _matrix(V, off_b, off_hk, stride_vb, stride_vh, TMA)
    dq = tl.full([BLOCK_M, HEAD_D], 0.0, dtype=tl.float32)

    if N_TERMS > 0:
        tv = TV + off_b * stride_tvb
        tb = TB + off_b * stride_tbb
        n_k = tl.cdiv(kv_len, BLOCK_N)
        if CAUSAL:
            n_k = tl.minimum(n_k, tl.cdiv(start_m + BLOCK_M, BLOCK_N))
        first, end = _tile_range(tb, stride_tbt, stride_tbr, start_m // BLOCK_M, 0, n_k, True, N_TERMS, OPS)
        dq = _dq_term_tiles(dq, q, do, lse, delta, k_src, v_src, off_b, off_hk,
                            stride_kn, stride_kd, stride_vn, stride_vd,
                            offs_m, first * BLOCK_N, end * BLOCK_N, seq_len, kv_len, qk_scale,
                            tv, tb, stride_tvt, stride_tvs, stride_tbt, stride_tbr, start_m // BLOCK_M,
                            HEAD_D, BLOCK_N, N_TERMS, OPS, DOT_PREC, TMA)
    else:
        if CAUSAL:
            full_hi = start_m
            masked_hi = tl.minimum(start_m + BLOCK_M, seq_len)
        else:
            full_hi = (seq_len // BLOCK_N) * BLOCK_N
            masked_hi = seq_len
        dq = _dq_tiles(dq, q, do, lse, delta, k_src, v_src, off_b, off_hk, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_m, 0, full_hi, seq_len, qk_scale, HEAD_D, BLOCK_N, False, CAUSAL, DOT_PREC, TMA)
        dq = _dq_tiles(dq, q, do, lse, delta, k_src, v_src, off_b, off_hk, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_m, full_hi, masked_hi, seq_len, qk_scale, HEAD_D, BLOCK_N, True, CAUSAL, DOT_PREC, TMA)
    dq = dq * sm_scale
    _store_rows(_matrix(DQ, off_b, off_h, stride_dqb, stride_dqh, TMA), off_b, off_h, start_m, stride_dqm, stride_dqd,
                seq_len, dq.to(q.dtype), BLOCK_M, HEAD_D, TMA)


# ---------------------------------------------------------------- kernels: masks as comparison terms
# masked_attention's Triton path (maskterms.py): the mask is a conjunction of N_TERMS terms
# `A[q] op B[k]`, A and B int64 vectors in TV ([term, 0 | 1, batch, position]), op term t's code in
# bits 2t..2t+1 of the constexpr OPS (0 <=, 1 ==, 2 !=). TB holds each vector's min and max per tile
# ([term, row, batch, tile]: rows 0, 1 A per query tile, 2, 3 B per key tile, at the kernel's own
# tile sizes). From those bounds a tile is skipped (some term fails for every pair), run without
# mask arithmetic (every term holds for every pair, no padded key), or masked.
# Each program first scans the bounds of all its streamed tiles, 256 at a time, for the first and
# last tile that can hold a kept pair, then loops over that range only: with document ids that grow
# along the sequence the range is the tiles meeting the documents of its own tile, so a program's
# cost follows its documents' lengths and the whole kernel sum(doc_len^2), not s^2; tiles inside
# the range that no pair survives (layouts that are not monotone) are skipped without a dot. CAUSAL
# (some term implies k <= q) bounds the scan itself at the diagonal. The scan costs a program
# s / (256 * tile) vector steps over 4 int64 per term and tile: next to the dots, nothing.


@kernel
def _term_bounds(a0, a1, b0, b1, OP: tl.constexpr):
    # a in [a0, a1], b in [b0, b1]: (some pair can pass `a op b`, some pair can fail it)
    if OP == 0:      # a <= b
        some = a0 <= b1
        mixed = a1 > b0
    elif OP == 1:    # a == b
        some = (a0 <= b1) & (b0 <= a1)
        mixed = (a0 != a1) | (b0 != b1) | (a0 != b0)
    else:            # a != b
        some = (a0 != a1) | (b0 != b1) | (a0 != b0)
        mixed = (a1 >= b0) & (b1 >= a0)
    return some, mixed


@kernel
def _term_compare(a, b, OP: tl.constexpr):
    if OP == 0:
        keep = a <= b
    elif OP == 1:
        keep = a == b
    else:
        keep = a != b
    return keep


@kernel
def _tile_state(tb, stride_bt, stride_br, tile_q, tile_k, N_TERMS: tl.constexpr, OPS: tl.constexpr):
    # (some pair of query tile tile_q x key tile tile_k passes every term, some pair fails one)
    for t in tl.static_range(N_TERMS):
        base = tb + t * stride_bt
        s, m = _term_bounds(tl.load(base + tile_q), tl.load(base + stride_br + tile_q),
                            tl.load(base + 2 * stride_br + tile_k), tl.load(base + 3 * stride_br + tile_k),
                            (OPS >> (2 * t)) & 3)
        if t == 0:
            some = s
            mixed = m
        else:
            some = some & s
            mixed = mixed | m
    return some, mixed


@kernel
def _tile_range(tb, stride_bt, stride_br, tile, lo, hi,
                QUERY_STATIONARY: tl.constexpr, N_TERMS: tl.constexpr, OPS: tl.constexpr):
    # The first and one past the last streamed tile in [lo, hi) that can hold a kept pair with the
    # stationary `tile` (query tiles x key tiles if QUERY_STATIONARY, else the transpose); empty
    # (first >= end) when none can.
    first = tl.zeros([], dtype=tl.int32) + hi
    end = tl.zeros([], dtype=tl.int32) + lo
    for c in range(lo, hi, 256):
        idx = c + tl.arange(0, 256)
        some = idx < hi
        for t in tl.static_range(N_TERMS):
            base = tb + t * stride_bt
            if QUERY_STATIONARY:
                a0 = tl.load(base + tile)
                a1 = tl.load(base + stride_br + tile)
                b0 = tl.load(base + 2 * stride_br + idx, mask=idx < hi, other=0)
                b1 = tl.load(base + 3 * stride_br + idx, mask=idx < hi, other=0)
            else:
                a0 = tl.load(base + idx, mask=idx < hi, other=0)
                a1 = tl.load(base + stride_br + idx, mask=idx < hi, other=0)
                b0 = tl.load(base + 2 * stride_br + tile)
                b1 = tl.load(base + 3 * stride_br + tile)
            s, _ = _term_bounds(a0, a1, b0, b1, (OPS >> (2 * t)) & 3)
            some = some & s
        first = tl.minimum(first, tl.min(tl.where(some, idx, hi), 0))
        end = tl.maximum(end, tl.max(tl.where(some, idx + 1, lo), 0))
    return first, end


@kernel
def _terms_keep(tv, stride_vt, stride_vs, offs_m, offs_n, seq_len, kv_len,
                N_TERMS: tl.constexpr, OPS: tl.constexpr, TRANSPOSED: tl.constexpr):
    # The mask of a tile: every term, and keys before kv_len; [M, N], or [N, M] if TRANSPOSED.
    if TRANSPOSED:
        keep = offs_n[:, None] < kv_len
    else:
        keep = offs_n[None, :] < kv_len
    for t in tl.static_range(N_TERMS):
        a = tl.load(tv + t * stride_vt + offs_m, mask=offs_m < seq_len, other=0)
        b = tl.load(tv + t * stride_vt + stride_vs + offs_n, mask=offs_n < seq_len, other=0)
        if TRANSPOSED:
            keep = keep & _term_compare(a[None, :], b[:, None], (OPS >> (2 * t)) & 3)
        else:
            keep = keep & _term_compare(a[:, None], b[None, :], (OPS >> (2 * t)) & 3)
    return keep


@kernel
def _visits_probe(TB, OUT, stride_bt, stride_br, n_k, N_TERMS: tl.constexpr, OPS: tl.constexpr):
    # grid (query tiles,): how many key tiles the forward computes for each query tile (tests, bench)
    tile_q = tl.program_id(0)
    first, end = _tile_range(TB, stride_bt, stride_br, tile_q, 0, n_k, True, N_TERMS, OPS)
    count = tl.zeros([], dtype=tl.int32)
    for tile_k in range(first, end):
        some, _ = _tile_state(TB, stride_bt, stride_br, tile_q, tile_k, N_TERMS, OPS)
        count += some.to(tl.int32)
    tl.store(OUT + tile_q, count)


@kernel
def _fwd_term_tiles(acc, l_i, m_i, q, k_src, v_src, off_b, off_hk,
                    stride_kn, stride_kd, stride_vn, stride_vd,
                    offs_m, lo, hi, seq_len, kv_len, qk_scale,
                    tv, tb, stride_vt, stride_vs, stride_bt, stride_br, tile_q,
                    HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr, N_TERMS: tl.constexpr, OPS: tl.constexpr,
                    DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    # _fwd_tiles under a terms mask: key rows lo..hi, each tile skipped, run whole or masked
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        some, mixed = _tile_state(tb, stride_bt, stride_br, tile_q, start_n // BLOCK_N, N_TERMS, OPS)
        if some:
            offs_n = start_n + offs_n0
            kt = _load_rows_t(k_src, off_b, off_hk, start_n, stride_kn, stride_kd, seq_len, BLOCK_N, HEAD_D, True, TMA)
            v = _load_rows(v_src, off_b, off_hk, start_n, stride_vn, stride_vd, seq_len, BLOCK_N, HEAD_D, True, TMA)
            qk = tl.dot(q, kt, input_precision=DOT_PREC)
            if mixed | (start_n + BLOCK_N > kv_len):
                keep = _terms_keep(tv, stride_vt, stride_vs, offs_m, offs_n, seq_len, kv_len, N_TERMS, OPS, False)
                qk = tl.where(keep, qk, float("-inf"))
            acc, l_i, m_i = _softmax_update(acc, l_i, m_i, qk, v, qk_scale, True, DOT_PREC)
    return acc, l_i, m_i


@kernel
def _dkdv_term_tiles(dk, dv, k, v, q_src, do_src, off_b, off_h, lse_base, delta_base,
                     stride_qm, stride_qd, stride_dom, stride_dod,
                     offs_n, lo, hi, seq_len, kv_len, qk_scale,
                     tv, tb, stride_vt, stride_vs, stride_bt, stride_br, tile_k, key_tail,
                     HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, N_TERMS: tl.constexpr, OPS: tl.constexpr,
                     DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    # _dkdv_tiles under a terms mask: query rows lo..hi of one head; key_tail: the key tile reaches
    # past kv_len (every tile masked)
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        some, mixed = _tile_state(tb, stride_bt, stride_br, start_m // BLOCK_M, tile_k, N_TERMS, OPS)
        if some:
            offs_m = start_m + offs_m0
            row_ok = offs_m < seq_len
            qt = _load_rows_t(q_src, off_b, off_h, start_m, stride_qm, stride_qd, seq_len, BLOCK_M, HEAD_D, True, TMA)
            do = _load_rows(do_src, off_b, off_h, start_m, stride_dom, stride_dod, seq_len, BLOCK_M, HEAD_D, True, TMA)
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=0.0)    # log2 units, +inf: P = 0
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
            pt = tl.math.exp2(tl.dot(k, qt, input_precision=DOT_PREC) * qk_scale - lse[None, :])
            if mixed | key_tail:
                keep = _terms_keep(tv, stride_vt, stride_vs, offs_m, offs_n, seq_len, kv_len, N_TERMS, OPS, True)
                pt = tl.where(keep, pt, 0.0)
            dk, dv = _dkdv_update(dk, dv, pt, v, qt, do, delta, DOT_PREC)
    return dk, dv


@kernel
def _dq_term_tiles(dq, q, do, lse, delta, k_src, v_src, off_b, off_hk,
                   stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, lo, hi, seq_len, kv_len, qk_scale,
                   tv, tb, stride_vt, stride_vs, stride_bt, stride_br, tile_q,
                   HEAD_D: tl.constexpr, BLOCK_N: tl.constexpr, N_TERMS: tl.constexpr, OPS: tl.constexpr,
                   DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    # _dq_tiles under a terms mask; lse in log2 units, +inf on rows that attend nothing
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        some, mixed = _tile_state(tb, stride_bt, stride_br, tile_q, start_n // BLOCK_N, N_TERMS, OPS)
        if some:
            offs_n = start_n + offs_n0
            kt = _load_rows_t(k_src, off_b, off_hk, start_n, stride_kn, stride_kd, seq_len, BLOCK_N, HEAD_D, True, TMA)
            vt = _load_rows_t(v_src, off_b, off_hk, start_n, stride_vn, stride_vd, seq_len, BLOCK_N, HEAD_D, True, TMA)
            p = tl.math.exp2(tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale - lse[:, None])
            if mixed | (start_n + BLOCK_N > kv_len):
                keep = _terms_keep(tv, stride_vt, stride_vs, offs_m, offs_n, seq_len, kv_len, N_TERMS, OPS, False)
                p = tl.where(keep, p, 0.0)
            dq = _dq_update(dq, p, do, kt, vt, delta, DOT_PREC)
    return dq


# ---------------------------------------------------------------- launchers


def load_kernels() -> None:
    """Import triton and jit this module's kernels (once; the first Triton call does it)."""
    jit_module(globals())


def dot_precision(dtype: torch.dtype):
    """fp32 inputs get IEEE dots (TF32 would miss the 1e-5 contract); 16-bit: the default."""
    return "ieee" if dtype == torch.float32 else None


def _mask_args(tiles, tile_q: int, tile_k: int, seq_len: int, placeholder: torch.Tensor):
    """The kernels' mask arguments (TV, TB, six strides, kv_len) and constexprs (N_TERMS, OPS) for a
    launch with query tiles of tile_q rows and key tiles of tile_k: a maskterms.TileMask's, or, for
    plain attention (tiles None), a placeholder the kernels never read."""
    if tiles is None:
        return (placeholder, placeholder, 0, 0, 0, 0, 0, 0, seq_len), dict(N_TERMS=0, OPS=0)
    vec, tb = tiles.vectors, tiles.bounds(tile_q, tile_k)
    args = (vec, tb, vec.stride(0), vec.stride(1), tiles.batch_stride,
            tb.stride(0), tb.stride(1), tb.stride(2) if tb.shape[2] > 1 else 0, tiles.kv_len)
    return args, dict(N_TERMS=tiles.n_terms, OPS=tiles.ops)


def tma_problem(t: torch.Tensor) -> Optional[str]:
    """Why a tensor descriptor cannot address t (TMA needs a 16-byte aligned base, unit stride on
    the last dim and every other stride a multiple of 16 bytes), or None."""
    size = t.element_size()
    if t.stride(-1) != 1:
        return f"last-dim stride {t.stride(-1)} (needs 1)"
    if any(st * size % 16 or st * size >= 2**40 for st in t.stride()[:-1]):
        return f"strides {tuple(t.stride())} of {size}-byte elements (need multiples of 16 bytes)"
    if t.device.type != "meta" and t.data_ptr() % 16:
        return "base address not 16-byte aligned"
    if max(t.shape) >= 2**31:
        return f"shape {tuple(t.shape)} (dims < 2**31)"
    return None


@functools.cache
def _host_descriptors():
    """Triton's host-side TensorDescriptor class (Triton >= 3.3), or None: older Tritons take pointers."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


def _tensors(cfg: dict, blocks: list):
    """The kernels' tensor arguments: `blocks` pairs each tensor with the rows of its tiles. With cfg's
    TMA on and every tensor addressable (tma_problem), 4-D tensor descriptors with [1, 1, rows, d]
    blocks, made here on the host (no device allocator involved); else the tensors (pointers)."""
    TensorDescriptor = _host_descriptors() if cfg.get("TMA") else None
    if TensorDescriptor is None or any(tma_problem(t) for t, _ in blocks):
        return False, [t for t, _ in blocks]
    return True, [TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, t.shape[3]]) for t, rows in blocks]


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                      cfg: dict, tiles=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward. q [b, hq, s, d], k/v [b, hkv, s, d], any strides, d a power of two
    in [16, 256] (the op pads other head dims). Returns o [b, hq, s, d]
    contiguous and lse fp32 [b, hq, s]. `tiles`: a maskterms.TileMask (masked_attention), with
    `causal` its Terms.causal; rows it empties get o 0 and lse -inf."""
    load_kernels()
    import triton

    b, hq, s, d = q.shape
    o = torch.empty((b, hq, s, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, s), dtype=torch.float32, device=q.device)
    mask_args, mask_consts = _mask_args(tiles, cfg["BLOCK_M"], cfg["BLOCK_N"], s, lse)
    tma, tensors = _tensors(cfg, [(q, cfg["BLOCK_M"]), (k, cfg["BLOCK_N"]), (v, cfg["BLOCK_N"]), (o, cfg["BLOCK_M"])])
    with launch_device(q):
        grid = check_grid((b * hq, triton.cdiv(s, cfg["BLOCK_M"])), f"flash attention forward at s={s}")
        _attn_fwd[grid](
            *tensors, lse,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), *mask_args,
            hq, hq // k.shape[1], s, scale * LOG2E,
            HEAD_D=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal,
            DOT_PREC=dot_precision(q.dtype), **mask_consts, TMA=tma, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
    return o, lse


def attention_backward(do, q, k, v, o, lse, dlse, causal: bool, scale: float, cfg: dict, tiles=None):
    """Launch the backward. Shapes as in `attention_forward`; lse fp32 [b, hq, s] from it;
    dlse None or [b, hq, s]. Returns dq [b, hq, s, d], dk, dv [b, hkv, s, d], contiguous.
    `tiles` as in attention_forward."""
    load_kernels()
    import triton

    b, hq, s, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    lse = lse.to(torch.float32).contiguous()
    delta = torch.empty((b, hq, s), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    dlse = None if dlse is None else dlse.to(torch.float32).contiguous()
    with launch_device(q):
        pre_block = 64
        _bwd_preprocess[(triton.cdiv(s, pre_block), b * hq)](
            o, do, delta if dlse is None else dlse, delta, lse, lse2, *o.stride(), *do.stride(), hq, s,
            HEAD_D=d, BLOCK_M=pre_block, HAS_DLSE=dlse is not None, num_warps=4,
        )
        dq = torch.empty((b, hq, s, d), dtype=q.dtype, device=q.device)
        dk = torch.empty((b, hkv, s, d), dtype=k.dtype, device=k.device)
        dv = torch.empty((b, hkv, s, d), dtype=v.dtype, device=v.device)
        common = dict(HEAD_D=d, CAUSAL=causal, DOT_PREC=dot_precision(q.dtype),
                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        mask_args, mask_consts = _mask_args(tiles, cfg["BLOCK_M1"], cfg["BLOCK_N1"], s, lse)
        m1, n1 = cfg["BLOCK_M1"], cfg["BLOCK_N1"]
        tma, tensors = _tensors(cfg, [(q, m1), (k, n1), (v, n1), (do, m1), (dk, n1), (dv, n1)])
        _bwd_dkdv[check_grid((b * hkv, triton.cdiv(s, n1)), f"flash attention dK/dV at s={s}")](
            *tensors, lse2, delta,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *mask_args,
            hq, hkv, group, s, scale * LOG2E, scale,
            BLOCK_M=m1, BLOCK_N=n1, **common, **mask_consts, TMA=tma,
        )
        mask_args, mask_consts = _mask_args(tiles, cfg["BLOCK_M2"], cfg["BLOCK_N2"], s, lse)
        m2, n2 = cfg["BLOCK_M2"], cfg["BLOCK_N2"]
        tma, tensors = _tensors(cfg, [(q, m2), (k, n2), (v, n2), (do, m2), (dq, m2)])
        _bwd_dq[check_grid((b * hq, triton.cdiv(s, m2)), f"flash attention dQ at s={s}")](
            *tensors, lse2, delta,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *mask_args,
            hq, group, s, scale * LOG2E, scale,
            BLOCK_M=m2, BLOCK_N=n2, **common, **mask_consts, TMA=tma,
        )
    return dq, dk, dv


def tile_offsets_of(start: int, stride_r: int, stride_c: int, rows: int, cols: int, device="cpu"):
    """What tile_offsets and tile_offsets_t compute in a kernel, as int64 tensors (for tests)."""
    load_kernels()
    out = torch.zeros(rows, cols, dtype=torch.int64, device=device)
    out_t = torch.zeros(cols, rows, dtype=torch.int64, device=device)
    _offsets_probe[(1,)](out, out_t, start, stride_r, stride_c, ROWS=rows, COLS=cols)
    return out, out_t


def visited_tiles(tiles, tile_q: int, tile_k: int, batch: int = 0) -> torch.Tensor:
    """int32 [query tiles]: how many key tiles of tile_k keys the forward's scan and skip test
    (the kernels' own helpers) leave to compute for each query tile of tile_q rows, for batch
    element `batch` of a maskterms.TileMask, on the whole key range (no causal bound). Tests and
    benchmarks count the dots a mask costs with it."""
    load_kernels()
    tb = tiles.bounds(tile_q, tile_k)[:, :, min(batch, tiles.vectors.shape[2] - 1)].contiguous()
    n_q = -(-tiles.vectors.shape[3] // tile_q)
    out = torch.zeros(n_q, dtype=torch.int32, device=tb.device)
    with launch_device(tb):
        _visits_probe[(n_q,)](tb, out, tb.stride(0), tb.stride(1), -(-tiles.kv_len // tile_k),
                              N_TERMS=tiles.n_terms, OPS=tiles.ops)
    return out


# ---------------------------------------------------------------- checks


def _shapes(q, k, v) -> str:
    return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"


_CHECKED: set = set()     # signatures already checked: a training step calls with the same few


def check_inputs(q, k, v, causal, scale, backend) -> None:
    """Raise AutospError naming the shapes and the fix for anything the op does not take.
    A signature (shapes, dtypes, devices, flags) is checked once per process."""
    try:
        sig = tuple((tuple(t.shape), t.dtype, t.device) for t in (q, k, v)) + (
            type(causal), causal, type(scale), scale, backend)
        if sig in _CHECKED:
            return
    except (AttributeError, TypeError):      # not tensors, or unhashable: the checks below say what
        sig = None
    _check_inputs(q, k, v, causal, scale, backend)
    if sig is not None:
        if len(_CHECKED) > 4096:
            _CHECKED.clear()
        _CHECKED.add(sig)


def _check_inputs(q, k, v, causal, scale, backend) -> None:
    op = "flash_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            fail(op, f"{name} must be a Tensor, got {type(t).__name__}", "pass q, k, v as tensors")
        if t.dim() != 4:
            fail(op, f"{_shapes(q, k, v)}: {name} must be 4-D [batch, heads, seq, head_dim]",
                 f"for [batch, seq, heads, head_dim] inputs pass {name}.transpose(1, 2)")
    b, hq, s, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        fail(op, f"{_shapes(q, k, v)}: k and v must be [b, hkv, s, d] with q's b, s and d",
             "pad or slice them to one sequence length (for cross-attention use torch SDPA)")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        fail(op, f"{_shapes(q, k, v)}: query heads ({hq}) must be a multiple of key/value heads ({hkv}) for "
             "grouped-query attention", f"repeat k/v heads to a divisor of {hq}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        fail(op, f"{_shapes(q, k, v)}: dtypes {q.dtype}, {k.dtype}, {v.dtype}: q, k, v must share one floating "
             "dtype", "cast them with .to(q.dtype)")
    if not (q.device == k.device == v.device):
        fail(op, f"{_shapes(q, k, v)}: devices {q.device}, {k.device}, {v.device}", "move q, k, v to one device")
    if not isinstance(causal, bool):
        fail(op, f"causal must be a bool, got {causal!r}", "pass True or False")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        fail(op, f"scale must be None or a finite float, got {scale!r}", "pass None for 1/sqrt(head_dim)")
    if backend not in BACKENDS:
        fail(op, f"backend {backend!r} unknown", f"use one of {BACKENDS}")


def _kernel_unsupported(q: torch.Tensor) -> Optional[str]:
    """Why the kernels above cannot take q's dtype or head dim, with the fix; None if they can."""
    if q.dtype not in TRITON_DTYPES:
        return f"dtype {q.dtype} is not one of {TRITON_DTYPES}; cast, or use backend='torch'"
    if q.shape[-1] > MAX_TRITON_HEAD_DIM:
        return f"head dim {q.shape[-1]} > {MAX_TRITON_HEAD_DIM} does not fit the kernel's tiles; use backend='torch'"
    return None


# ---------------------------------------------------------------- the ops


def _resolve_scale(scale: Optional[float], d: int) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(d)


def _padded_head_dim(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _pad(t: torch.Tensor, dp: int) -> torch.Tensor:
    return t if t.shape[-1] == dp else F.pad(t, (0, dp - t.shape[-1]))


def terms_forward_config(cfg: dict, hip: bool | None = None) -> dict:
    """The forward's config for a terms mask: key tiles of at most 64, 8 warps for 128-row query
    tiles. The terms forward also holds the mask vectors and tile bounds: on sm_90 it spills at
    128x128 (bf16 d=128) and with 4 warps (fp16 d=64), and does not at 128x64 with 8 warps
    (bench/compile_sm90.py). On ROCm (`hip`, by default this torch's build) key tiles of at most 32:
    gfx942 spills 62 VGPRs at 128x64 with the sliding window's terms (bench/compile_rocm.py). Same
    BLOCK_M, so every tiling rule still holds."""
    hip = torch.version.hip is not None if hip is None else hip
    warps = max(cfg["num_warps"], 8) if cfg["BLOCK_M"] >= 128 else cfg["num_warps"]
    return dict(cfg, BLOCK_N=min(cfg["BLOCK_N"], 32 if hip else 64), num_warps=warps)


def _triton_forward(q, k, v, causal, scale, tiles=None):
    """The forward on any head dim (padded here) with the cached config; `tiles` as in attention_forward
    (masked_attention calls this too)."""
    d = q.shape[-1]
    dp = _padded_head_dim(d)
    cfg = config.lookup("flash_fwd", q.device, q.dtype, dp, causal, q.shape[2])
    if tiles is not None:
        cfg = terms_forward_config(cfg)
    out, lse = attention_forward(_pad(q, dp), _pad(k, dp), _pad(v, dp), causal, scale, cfg, tiles)
    return (out if dp == d else out[..., :d].contiguous()), lse


def _triton_backward(do, q, k, v, out, lse, dlse, causal, scale, tiles=None):
    d = q.shape[-1]
    dp = _padded_head_dim(d)
    cfg = config.lookup("flash_bwd", q.device, q.dtype, dp, causal, q.shape[2])
    grads = attention_backward(_pad(do, dp), _pad(q, dp), _pad(k, dp), _pad(v, dp), _pad(out, dp), lse, dlse,
                               causal, scale, cfg, tiles)
    return tuple(g if dp == d else g[..., :d].contiguous() for g in grads)


def _empty_outputs(q):
    b, hq, s, d = q.shape
    return q.new_empty((b, hq, s, d)), q.new_empty((b, hq, s), dtype=lse_dtype(q.dtype))


@torch.library.custom_op("autosp::flash_attention", mutates_args=())
def flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Optional[float],
                       backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs(q, k, v, causal, scale, backend)
    if q.numel() == 0:  # no rows, no programs: Triton cannot launch an empty grid
        out, lse = _empty_outputs(q)
        return out.zero_(), lse.fill_(float("-inf"))
    sc = _resolve_scale(scale, q.shape[-1])
    if resolve_backend("flash_attention", backend, q, _kernel_unsupported(q)) == "triton":
        return _triton_forward(q, k, v, causal, sc)
    return torch_forward(q, k, v, causal, sc)


@flash_attention_op.register_fake
def _flash_attention_fake(q, k, v, causal, scale, backend):
    check_inputs(q, k, v, causal, scale, backend)
    return _empty_outputs(q)


@torch.library.custom_op("autosp::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(
        dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        dlse: Optional[torch.Tensor], causal: bool, scale: Optional[float],
        backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_inputs(q, k, v, causal, scale, backend)
    if dout.shape != q.shape or lse.shape != q.shape[:3]:
        fail("flash_attention_backward", f"{_shapes(q, k, v)}, dout {tuple(dout.shape)}, lse {tuple(lse.shape)}: "
             "dout must be q's shape and lse [b, hq, s]", "pass the forward's outputs unchanged")
    if q.numel() == 0:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    sc = _resolve_scale(scale, q.shape[-1])
    dout = dout.to(q.dtype)
    if resolve_backend("flash_attention", backend, q, _kernel_unsupported(q)) == "triton":
        return _triton_backward(dout, q, k, v, out, lse, dlse, causal, sc)
    return torch_backward(dout, q, k, v, out, lse, dlse, causal, sc)


@flash_attention_backward_op.register_fake
def _flash_attention_backward_fake(dout, q, k, v, out, lse, dlse, causal, scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ---------------------------------------------------------------- autograd and the wrappers


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale, ctx.backend = causal, scale, backend
    ctx.set_materialize_grads(False)  # an unused LSE must cost nothing in the backward


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None and dlse is None:
        return None, None, None, None, None, None
    if dout is None:
        dout = torch.zeros_like(out)
    with torch.no_grad():  # the backward op has no derivative of its own (no double backward)
        dq, dk, dv = flash_attention_backward_op(dout, q, k, v, out, lse, dlse, ctx.causal, ctx.scale, ctx.backend)
    return dq, dk, dv, None, None, None


flash_attention_with_lse = differentiable(flash_attention_op, _setup_context, _backward)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: Optional[float] = None, backend: str = "auto") -> torch.Tensor:
    """Attention of q [b, hq, s, d] over k, v [b, hkv, s, d] (GQA when hkv < hq); differentiable.

    `scale` defaults to 1/sqrt(d). See the module docstring for the backends."""
    check_inputs(q, k, v, causal, scale, backend)  # errors name this call, not the op's internals
    return flash_attention_with_lse(q, k, v, causal, None if scale is None else float(scale), backend)[0]


def _attention_pairs(s: int, causal: bool) -> int:
    return s * (s + 1) // 2 if causal else s * s


def _register_flop_formulas() -> None:
    """FLOPs for torch.utils.flop_counter (and the remat cost model): 2 matmuls forward, 5 backward
    (P is recomputed), over the unmasked (query, key) pairs only."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    fwd, bwd = torch.ops.autosp.flash_attention, torch.ops.autosp.flash_attention_backward
    if fwd not in flop_registry:
        @register_flop_formula(fwd)
        def _fwd_flops(q_shape, k_shape, v_shape, causal, *args, out_shape=None, **kwargs) -> int:
            b, hq, s, d = q_shape
            return 4 * b * hq * d * _attention_pairs(s, causal)

    if bwd not in flop_registry:
        @register_flop_formula(bwd)
        def _bwd_flops(dout_shape, q_shape, k_shape, v_shape, o_shape, lse_shape, dlse_shape, causal, *args,
                       out_shape=None, **kwargs) -> int:
            b, hq, s, d = q_shape
            return 10 * b * hq * d * _attention_pairs(s, causal)


_register_flop_formulas()

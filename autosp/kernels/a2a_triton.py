"""Triton strided copy behind the Ulysses layout kernels (a2a.py).

Every Ulysses layout change (heads split into the send buffer, sequence chunks
concatenated out of the receive buffer, and their inverses) is one copy between
two 5-D strided views of the same index space (i0, i1, i2, row, d), where
`d` (the head dim) is contiguous on both sides. One program copies a
[BLOCK_R, D] tile: d-rows stay coalesced, and no permute().contiguous()
intermediate is ever materialised.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from autosp.kernels._triton import jit, launch_device


@jit
def _copy5(SRC, DST, n1, n2, n_rows,
           s0, s1, s2, s3, s4, t0, t1, t2, t3, t4,
           HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    # grid: (n0 * n1 * n2 * cdiv(n_rows, BLOCK_R),): one axis, so no 65535 limit on
    # the batch x heads x ranks product. s* / t*: source / destination strides.
    pid = tl.program_id(0).to(tl.int64)
    n_tiles = (n_rows + BLOCK_R - 1) // BLOCK_R
    tile = pid % n_tiles
    rest = pid // n_tiles
    i2 = rest % n2
    rest = rest // n2
    i1 = rest % n1
    i0 = rest // n1
    offs_r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_r < n_rows)[:, None] & (offs_d < HEAD_D)[None, :]
    src = SRC + i0 * s0 + i1 * s1 + i2 * s2 + offs_r[:, None] * s3 + offs_d[None, :] * s4
    dst = DST + i0 * t0 + i1 * t1 + i2 * t2 + offs_r[:, None] * t3 + offs_d[None, :] * t4
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


def copy5(dst: torch.Tensor, src: torch.Tensor, cfg: dict) -> None:
    """dst[...] = src for two 5-D views of one shape (n0, n1, n2, rows, d)."""
    n0, n1, n2, rows, d = src.shape
    if src.numel() == 0:
        return
    block_r = cfg["BLOCK_R"]
    grid = (n0 * n1 * n2 * triton.cdiv(rows, block_r),)
    with launch_device(src):
        _copy5[grid](src, dst, n1, n2, rows, *src.stride(), *dst.stride(),
                     HEAD_D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_R=block_r, num_warps=cfg["num_warps"])

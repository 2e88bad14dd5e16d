"""Row reductions that work in compiled kernels and in interpreted ones alike.

`tl.max`, `tl.sum` and `tl.zeros` are themselves `@triton.jit` library functions.
When triton was imported without TRITON_INTERPRET (torch's flop counter imports
it early), an interpreted kernel cannot call them (see `_triton.py`). The builtin
`tl.reduce` with the library's own combine functions is what `tl.max`/`tl.sum`
compile to for fp32 rows, and the interpreter recognises those combine functions
and reduces with numpy; our own combine function is the fallback should a
Triton release rename them (correct, only slower in the interpreter).
Kernels use `tl.full` instead of `tl.zeros` for the same reason.
"""
import triton.language as tl

from autosp.kernels._triton import jit


@jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@jit
def _sum_combine(a, b):
    return a + b


MAX_COMBINE = getattr(tl.standard, "_elementwise_max", None) or _max_combine
SUM_COMBINE = getattr(tl.standard, "_sum_combine", None) or _sum_combine


@jit
def row_max(x):
    # x [M, N] fp32 -> [M]
    return tl.reduce(x, 1, MAX_COMBINE)


@jit
def row_sum(x):
    # x [M, N] fp32 -> [M]
    return tl.reduce(x, 1, SUM_COMBINE)


@jit
def _probe_loop(X, n):
    # The interpreter features the kernels rely on: a loop with a runtime bound, a reduction.
    acc = tl.full([16], 0.0, dtype=tl.float32)
    for _ in range(0, n, 1):
        acc += 1.0
    tl.store(X + tl.arange(0, 16), acc + row_sum(acc[:, None] * 0.0))


def probe_interpreter() -> None:
    """Raise if this Triton's interpreter cannot run our kernels on CPU tensors."""
    import torch

    x = torch.zeros(16)
    _probe_loop[(1,)](x, 3)
    if not bool((x == 3).all()):
        raise RuntimeError(f"probe kernel computed {x.tolist()}, expected 3s")


# ---------------------------------------------------------------- 64-bit tile offsets
# A row offset `row * stride_row` passes 2**31 long before the tensor does: a [b, s, h, d] view
# (which flash_attention accepts without a copy) has stride_row = h * d, so s * h * d >= 2**31 at
# 128 heads x 128 at s = 128k. Every kernel takes its tile offsets from these helpers: the tile's
# first row in 64 bits, the rows inside the tile (at most a block times the stride) in 32.


@jit
def tile_offsets(start, stride_r, offs_c, stride_c, ROWS: tl.constexpr):
    # [ROWS, len(offs_c)] element offsets of rows start .. start + ROWS - 1, columns offs_c
    return tl.cast(start, tl.int64) * stride_r + (tl.arange(0, ROWS)[:, None] * stride_r
                                                  + offs_c[None, :] * stride_c)


@jit
def tile_offsets_t(start, stride_r, offs_c, stride_c, ROWS: tl.constexpr):
    # the same tile transposed: [len(offs_c), ROWS] (K^T, V^T and Q^T tiles for the dots)
    return tl.cast(start, tl.int64) * stride_r + (tl.arange(0, ROWS)[None, :] * stride_r
                                                  + offs_c[:, None] * stride_c)


@jit
def _offsets_probe(OUT, OUT_T, start, stride_r, stride_c, ROWS: tl.constexpr, COLS: tl.constexpr):
    cols = tl.arange(0, COLS)
    tl.store(OUT + tl.arange(0, ROWS)[:, None] * COLS + cols[None, :], tile_offsets(start, stride_r, cols, stride_c, ROWS))
    tl.store(OUT_T + cols[:, None] * ROWS + tl.arange(0, ROWS)[None, :],
             tile_offsets_t(start, stride_r, cols, stride_c, ROWS))


def tile_offsets_of(start: int, stride_r: int, stride_c: int, rows: int, cols: int, device="cpu"):
    """What tile_offsets and tile_offsets_t compute in a kernel, as int64 tensors (for tests)."""
    import torch

    out = torch.zeros(rows, cols, dtype=torch.int64, device=device)
    out_t = torch.zeros(cols, rows, dtype=torch.int64, device=device)
    _offsets_probe[(1,)](out, out_t, start, stride_r, stride_c, ROWS=rows, COLS=cols)
    return out, out_t

"""Ulysses layout kernels: Q/K/V into one all_to_all_single send buffer, and back.

Ulysses turns sequence-sharded activations [b, h, s/P, d] into head-sharded
[b, h/P, s, d] around attention with one all-to-all, and back after it. The
collective (all_to_all_single) moves `world` equal chunks of a flat buffer:
chunk r goes to rank r. These functions write those chunks straight from (and
read them straight into) the layouts attention and the model use: one strided
copy per tensor, no permute().contiguous() intermediate.

    send = ulysses_pack([q, k, v], P)          # q [b, hq, s/P, d] (any strides) -> 1-D
    recv = all_to_all_single(send)             # chunk r: rank r's sequence chunk, my heads
    q, k, v = ulysses_unpack(recv, [hq, hkv, hkv], b, s/P, d, P)   # [b, h/P, s, d]
    o = attention(q, k, v)                     # [b, hq/P, s, d]
    send = ulysses_pack_out(o, P)              # chunk r: sequence chunk r of my heads
    recv = all_to_all_single(send)
    o = ulysses_unpack_out(recv, b, hq/P, s/P, d, P)   # [b, hq, s/P, d]

Two generic layout changes and their inverses do all the work, each a custom op
(`autosp::ulysses_*`) with a fake, so traced graphs hold one node per call:
  pack_heads   x [b, (r hr), s, d] -> rank chunk r holds x[:, r*hr:(r+1)*hr]   (ulysses_pack)
  unpack_heads the inverse, outputs stored [b, s, h, d]                       (ulysses_unpack_out)
  pack_seq     x [b, h, (r s), d] -> rank chunk r holds x[:, :, r*s:(r+1)*s]  (ulysses_pack_out)
  unpack_seq   the inverse, outputs contiguous [b, h, world*s, d]             (ulysses_unpack)
Each is a permutation, so its backward is its inverse (`_ops.differentiable`; double
backward and torch.func work through it). Each is one strided copy between two 5-D
views of the same index space (i0, i1, i2, row, d), d contiguous on both sides: the
Triton kernel below copies [BLOCK_R, D] tiles (it loads on the first Triton call,
_triton.jit_module); the torch backend is one `copy_`. Backends as in flash.py
(_triton.resolve_backend). The public functions at the end check their arguments
(AutospError naming the shapes and the fix) before any op runs.
"""
from __future__ import annotations

import torch

from autosp.kernels import config
from autosp.kernels._ops import differentiable, fail
from autosp.kernels._triton import jit_module, kernel, launch_device, resolve_backend

tl = None  # triton.language: bound, and the @kernel function jitted, by the first copy5 call


# ---------------------------------------------------------------- the Triton copy


@kernel
def _copy5(SRC, DST, n1, n2, n_rows,
           s0, s1, s2, s3, s4, t0, t1, t2, t3, t4,
           HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    # grid: (n0 * n1 * n2 * cdiv(n_rows, BLOCK_R),): one axis, so no 65535 limit on
    # the batch x heads x ranks product. s* / t*: source / destination strides. The program
    # id is int64, so every offset is (a [b, s, h, d] view passes 2**31 elements at long s).
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
    jit_module(globals())
    import triton

    block_r = cfg["BLOCK_R"]
    grid = (n0 * n1 * n2 * triton.cdiv(rows, block_r),)
    with launch_device(src):
        _copy5[grid](src, dst, n1, n2, rows, *src.stride(), *dst.stride(),
                     HEAD_D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_R=block_r, num_warps=cfg["num_warps"])


# ---------------------------------------------------------------- the layouts


def _copy(dst5: torch.Tensor, src5: torch.Tensor, backend: str) -> None:
    if backend == "torch":
        dst5.copy_(src5)
        return
    d, rows = src5.shape[-1], src5.shape[-2]
    copy5(dst5, src5, config.lookup("layout_copy", src5.device, src5.dtype, d, False, rows))


def _chunks(buf: torch.Tensor, world: int, sizes: list[tuple[int, ...]]):
    """5-D views [world, *size] of each tensor's slot in every rank chunk of `buf`."""
    per_rank = buf.view(world, buf.numel() // world)
    off, views = 0, []
    for size in sizes:
        n = size[0] * size[1] * size[2] * size[3]
        views.append(per_rank[:, off:off + n].view(world, *size))
        off += n
    return views


def _pack_heads(xs, world: int, backend: str) -> torch.Tensor:
    # x [b, (r hr), s, d] -> chunk r holds x[:, r*hr:(r+1)*hr] as [b, hr, s, d]
    b, _, s, d = xs[0].shape
    sizes = [(b, x.shape[1] // world, s, d) for x in xs]
    buf = xs[0].new_empty(sum(x.numel() for x in xs))
    for dst, x, size in zip(_chunks(buf, world, sizes), xs, sizes):
        _copy(dst, x.unflatten(1, (world, size[1])).transpose(0, 1), backend)
    return buf


def _unpack_heads(buf, head_counts, b, s, d, world, backend) -> list[torch.Tensor]:
    # inverse of _pack_heads; outputs are [b, s, h, d] in memory, returned as [b, h, s, d]
    # views: the layout the model had before attention (and wants after it).
    sizes = [(b, h // world, s, d) for h in head_counts]
    outs = []
    for src, h, size in zip(_chunks(buf, world, sizes), head_counts, sizes):
        out = buf.new_empty((b, s, h, d)).transpose(1, 2)
        _copy(out.unflatten(1, (world, size[1])).transpose(0, 1), src, backend)
        outs.append(out)
    return outs


def _pack_seq(xs, world: int, backend: str) -> torch.Tensor:
    # x [b, h, (r s), d] -> chunk r holds x[:, :, r*s:(r+1)*s] as [b, h, s, d]
    b, _, seq, d = xs[0].shape
    s = seq // world
    sizes = [(b, x.shape[1], s, d) for x in xs]
    buf = xs[0].new_empty(sum(x.numel() for x in xs))
    for dst, x in zip(_chunks(buf, world, sizes), xs):
        _copy(dst, x.unflatten(2, (world, s)).permute(2, 0, 1, 3, 4), backend)
    return buf


def _unpack_seq(buf, heads, b, s, d, world, backend) -> list[torch.Tensor]:
    # inverse of _pack_seq: outputs [b, h, world*s, d], contiguous (attention's layout)
    sizes = [(b, h, s, d) for h in heads]
    outs = []
    for src, h in zip(_chunks(buf, world, sizes), heads):
        out = buf.new_empty((b, h, world * s, d))
        _copy(out.view(b, h, world, s, d).permute(2, 0, 1, 3, 4), src, backend)
        outs.append(out)
    return outs


# ---------------------------------------------------------------- the ops


@torch.library.custom_op("autosp::ulysses_pack_heads", mutates_args=())
def pack_heads_op(xs: list[torch.Tensor], world: int, backend: str) -> torch.Tensor:
    return _pack_heads(xs, world, resolve_backend("ulysses_pack", backend, xs[0]))


@pack_heads_op.register_fake
def _(xs, world, backend):
    return xs[0].new_empty(sum(x.numel() for x in xs))


@torch.library.custom_op("autosp::ulysses_unpack_heads", mutates_args=())
def unpack_heads_op(buf: torch.Tensor, head_counts: list[int], b: int, s: int, d: int, world: int,
                    backend: str) -> list[torch.Tensor]:
    return _unpack_heads(buf, head_counts, b, s, d, world, resolve_backend("ulysses_unpack_out", backend, buf))


@unpack_heads_op.register_fake
def _(buf, head_counts, b, s, d, world, backend):
    return [buf.new_empty((b, s, h, d)).transpose(1, 2) for h in head_counts]


@torch.library.custom_op("autosp::ulysses_pack_seq", mutates_args=())
def pack_seq_op(xs: list[torch.Tensor], world: int, backend: str) -> torch.Tensor:
    return _pack_seq(xs, world, resolve_backend("ulysses_pack_out", backend, xs[0]))


@pack_seq_op.register_fake
def _(xs, world, backend):
    return xs[0].new_empty(sum(x.numel() for x in xs))


@torch.library.custom_op("autosp::ulysses_unpack_seq", mutates_args=())
def unpack_seq_op(buf: torch.Tensor, heads: list[int], b: int, s: int, d: int, world: int,
                  backend: str) -> list[torch.Tensor]:
    return _unpack_seq(buf, heads, b, s, d, world, resolve_backend("ulysses_unpack", backend, buf))


@unpack_seq_op.register_fake
def _(buf, heads, b, s, d, world, backend):
    return [buf.new_empty((b, h, world * s, d)) for h in heads]


# ---------------------------------------------------------------- autograd: the inverse layout


def _grads_or_zeros(grads, like):
    return [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype, device) in zip(grads, like)]


def _save_list_shape(ctx, inputs, output):
    xs, world, backend = inputs
    ctx.meta = ([x.shape[1] for x in xs], xs[0].shape[0], xs[0].shape[2], xs[0].shape[3], world, backend)


def _save_buf_args(ctx, inputs, output):
    ctx.meta = tuple(inputs[1:])
    ctx.out_like = [(o.shape, o.dtype, o.device) for o in output]  # for the grads of unused outputs


def _pack_heads_bwd(ctx, g):
    heads, b, s, d, world, backend = ctx.meta
    return unpack_heads(g, heads, b, s, d, world, backend), None, None


def _unpack_heads_bwd(ctx, grads):
    head_counts, b, s, d, world, backend = ctx.meta
    return pack_heads(_grads_or_zeros(grads, ctx.out_like), world, backend), None, None, None, None, None, None


def _pack_seq_bwd(ctx, g):
    heads, b, seq, d, world, backend = ctx.meta
    return unpack_seq(g, heads, b, seq // world, d, world, backend), None, None


def _unpack_seq_bwd(ctx, grads):
    heads, b, s, d, world, backend = ctx.meta
    return pack_seq(_grads_or_zeros(grads, ctx.out_like), world, backend), None, None, None, None, None, None


pack_heads = differentiable(pack_heads_op, _save_list_shape, _pack_heads_bwd)
unpack_heads = differentiable(unpack_heads_op, _save_buf_args, _unpack_heads_bwd)
pack_seq = differentiable(pack_seq_op, _save_list_shape, _pack_seq_bwd)
unpack_seq = differentiable(unpack_seq_op, _save_buf_args, _unpack_seq_bwd)


# ---------------------------------------------------------------- checks


def _is_int(v) -> bool:
    # SymInt too: the shapes may be symbolic while the sharding pass traces.
    return isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool)


def _check_world(op: str, world) -> None:
    if not _is_int(world) or world < 1:
        fail(op, f"world must be a positive int, got {world!r}", "pass the sp group size")


def _check_list(op: str, xs, seq_dim_name: str) -> None:
    if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)) or len(xs) == 0:
        fail(op, f"expected a non-empty list of tensors, got {type(xs).__name__}", "pass [q, k, v]")
    shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in xs]
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in xs):
        fail(op, f"inputs {shapes} must all be 4-D [b, heads, {seq_dim_name}, d]",
             "pass x.transpose(1, 2) of a [b, seq, heads, d] tensor")
    x0 = xs[0]
    for x in xs[1:]:
        if (x.shape[0], x.shape[2], x.shape[3]) != (x0.shape[0], x0.shape[2], x0.shape[3]) \
                or x.dtype != x0.dtype or x.device != x0.device:
            fail(op, f"inputs {shapes} ({[str(x.dtype) for x in xs]}) must share b, {seq_dim_name}, d, dtype and "
                 f"device", "pack tensors of one attention call together")


def _check_counts(op: str, head_counts, world: int) -> list[int]:
    counts = list(head_counts)
    if not counts or any(not _is_int(h) or h < 0 for h in counts):
        fail(op, f"head_counts {counts!r} must be a non-empty list of non-negative ints", "pass [hq, hkv, hkv]")
    if any(h % world for h in counts):
        fail(op, f"head counts {counts} are not all divisible by world={world}",
             f"replicate K/V heads to a multiple of {world} (repeat_interleave on the head dim) before packing")
    return counts


def _check_dims(op: str, **dims) -> None:
    bad = {k: v for k, v in dims.items() if not _is_int(v) or v < 0}
    if bad:
        fail(op, f"sizes {bad} must be non-negative ints", "pass the local shape as Python ints")


def _check_buf(op: str, buf, expected: int, what: str) -> None:
    if not isinstance(buf, torch.Tensor) or buf.dim() != 1:
        fail(op, f"buf must be a 1-D tensor, got {getattr(buf, 'shape', type(buf).__name__)}",
             "pass the all_to_all_single receive buffer")
    if buf.numel() != expected:
        fail(op, f"buf has {buf.numel()} elements but {what} needs {expected}",
             "pass the head counts, b, s_loc, d and world the buffer was packed with")


# ---------------------------------------------------------------- public API


def ulysses_pack(xs: list[torch.Tensor], world: int, backend: str = "auto") -> torch.Tensor:
    """Send buffer (1-D, contiguous) of one all_to_all_single: chunk r holds, for each x in
    order, x[:, r*h/world:(r+1)*h/world] as a contiguous [b, h/world, s_loc, d].

    xs: [b, h_i, s_loc, d] tensors of any strides (typically transposes of [b, s_loc, h_i, d])
    sharing b, s_loc, d, dtype and device; h_i % world == 0."""
    op = "ulysses_pack"
    _check_world(op, world)
    _check_list(op, xs, "s_loc")
    _check_counts(op, [x.shape[1] for x in xs], world)
    resolve_backend(op, backend, xs[0])
    return pack_heads(list(xs), world, backend)


def ulysses_unpack(buf: torch.Tensor, head_counts: list[int], b: int, s_loc: int, d: int, world: int,
                   backend: str = "auto") -> list[torch.Tensor]:
    """Inverse side of `ulysses_pack` after all_to_all_single: chunk r of `buf` came from rank r
    and holds its sequence chunk r. Returns, per global head count h_i, a contiguous
    [b, h_i/world, world*s_loc, d] (the sequence is the chunks concatenated in rank order)."""
    op = "ulysses_unpack"
    _check_world(op, world)
    counts = _check_counts(op, head_counts, world)
    _check_dims(op, b=b, s_loc=s_loc, d=d)
    _check_buf(op, buf, b * sum(counts) * s_loc * d, f"head_counts {counts}, b={b}, s_loc={s_loc}, d={d}")
    resolve_backend(op, backend, buf)
    return unpack_seq(buf, [h // world for h in counts], b, s_loc, d, world, backend)


def ulysses_pack_out(o: torch.Tensor, world: int, backend: str = "auto") -> torch.Tensor:
    """Send buffer after attention: chunk r = o[:, :, r*S/world:(r+1)*S/world] as a contiguous
    [b, h_loc, S/world, d]; o is [b, h_loc, S, d] of any strides, S % world == 0."""
    op = "ulysses_pack_out"
    _check_world(op, world)
    _check_list(op, [o], "S")
    if o.shape[2] % world:
        fail(op, f"o {tuple(o.shape)}: sequence length {o.shape[2]} is not divisible by world={world}",
             f"pad the sequence to a multiple of {world}")
    resolve_backend(op, backend, o)
    return pack_seq([o], world, backend)


def ulysses_unpack_out(buf: torch.Tensor, b: int, h_loc: int, s_loc: int, d: int, world: int,
                       backend: str = "auto") -> torch.Tensor:
    """Inverse side of `ulysses_pack_out` after all_to_all_single: [b, world*h_loc, s_loc, d],
    chunk r giving heads r*h_loc:(r+1)*h_loc. Stored as [b, s_loc, heads, d] (returned
    transposed), so the usual `.transpose(1, 2).reshape(b, s_loc, -1)` is free."""
    op = "ulysses_unpack_out"
    _check_world(op, world)
    _check_dims(op, b=b, h_loc=h_loc, s_loc=s_loc, d=d)
    _check_buf(op, buf, world * b * h_loc * s_loc * d, f"b={b}, h_loc={h_loc}, s_loc={s_loc}, d={d}, world={world}")
    resolve_backend(op, backend, buf)
    return unpack_heads(buf, [world * h_loc], b, s_loc, d, world, backend)[0]


def ulysses_unpack_heads(buf: torch.Tensor, head_counts: list[int], b: int, s_loc: int, d: int, world: int,
                         backend: str = "auto") -> list[torch.Tensor]:
    """The exact inverse of `ulysses_pack` (its backward): [b, h_i, s_loc, d] per global h_i."""
    op = "ulysses_unpack_heads"
    _check_world(op, world)
    counts = _check_counts(op, head_counts, world)
    _check_dims(op, b=b, s_loc=s_loc, d=d)
    _check_buf(op, buf, b * sum(counts) * s_loc * d, f"head_counts {counts}, b={b}, s_loc={s_loc}, d={d}")
    resolve_backend(op, backend, buf)
    return unpack_heads(buf, counts, b, s_loc, d, world, backend)

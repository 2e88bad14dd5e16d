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

Each is a `torch.library` custom op with a fake and autograd (the backward of a
layout change is the inverse layout change; a2a_ops.py), so traced graphs hold
one node per call and differentiate through it, with torch.func too. Backends:
"torch" (one `copy_` between strided views), "triton" (a2a_triton.py; CPU
tensors run in the interpreter), "auto" = Triton on CUDA/ROCm tensors when
Triton imports. This module checks the arguments (AutospError naming the shapes
and the fix) before any op runs.
"""
from __future__ import annotations

import torch

from autosp.kernels.a2a_ops import fail as _fail
from autosp.kernels.a2a_ops import pack_heads, pack_seq, resolve_backend, unpack_heads, unpack_seq


# ---------------------------------------------------------------- checks


def _is_int(v) -> bool:
    # SymInt too: the shapes may be symbolic while the sharding pass traces.
    return isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool)


def _check_world(op: str, world) -> None:
    if not _is_int(world) or world < 1:
        _fail(op, f"world must be a positive int, got {world!r}", "pass the sp group size")


def _check_list(op: str, xs, seq_dim_name: str) -> None:
    if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)) or len(xs) == 0:
        _fail(op, f"expected a non-empty list of tensors, got {type(xs).__name__}", "pass [q, k, v]")
    shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in xs]
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in xs):
        _fail(op, f"inputs {shapes} must all be 4-D [b, heads, {seq_dim_name}, d]",
              "pass x.transpose(1, 2) of a [b, seq, heads, d] tensor")
    x0 = xs[0]
    for x in xs[1:]:
        if (x.shape[0], x.shape[2], x.shape[3]) != (x0.shape[0], x0.shape[2], x0.shape[3]) \
                or x.dtype != x0.dtype or x.device != x0.device:
            _fail(op, f"inputs {shapes} ({[str(x.dtype) for x in xs]}) must share b, {seq_dim_name}, d, dtype and "
                  f"device", "pack tensors of one attention call together")


def _check_counts(op: str, head_counts, world: int) -> list[int]:
    counts = list(head_counts)
    if not counts or any(not _is_int(h) or h < 0 for h in counts):
        _fail(op, f"head_counts {counts!r} must be a non-empty list of non-negative ints", "pass [hq, hkv, hkv]")
    if any(h % world for h in counts):
        _fail(op, f"head counts {counts} are not all divisible by world={world}",
              f"replicate K/V heads to a multiple of {world} (repeat_interleave on the head dim) before packing")
    return counts


def _check_dims(op: str, **dims) -> None:
    bad = {k: v for k, v in dims.items() if not _is_int(v) or v < 0}
    if bad:
        _fail(op, f"sizes {bad} must be non-negative ints", "pass the local shape as Python ints")


def _check_buf(op: str, buf, expected: int, what: str) -> None:
    if not isinstance(buf, torch.Tensor) or buf.dim() != 1:
        _fail(op, f"buf must be a 1-D tensor, got {getattr(buf, 'shape', type(buf).__name__)}",
              "pass the all_to_all_single receive buffer")
    if buf.numel() != expected:
        _fail(op, f"buf has {buf.numel()} elements but {what} needs {expected}",
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
        _fail(op, f"o {tuple(o.shape)}: sequence length {o.shape[2]} is not divisible by world={world}",
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


"""The custom ops behind the Ulysses layout kernels (public API and checks: a2a.py).

Two generic layout changes and their inverses do all the work:
  pack_heads   x [b, (r hr), s, d] -> rank chunk r holds x[:, r*hr:(r+1)*hr]   (ulysses_pack)
  unpack_heads the inverse, outputs stored [b, s, h, d]                       (ulysses_unpack_out)
  pack_seq     x [b, h, (r s), d] -> rank chunk r holds x[:, :, r*s:(r+1)*s]  (ulysses_pack_out)
  unpack_seq   the inverse, outputs contiguous [b, h, world*s, d]             (ulysses_unpack)
Each is a permutation, so its backward is its inverse. Each is a custom op with
a fake (tracing keeps one node per call) and autograd; the functions at the end
wrap them in autograd.Functions with `setup_context`, which torch.func accepts
(custom ops' own autograd is refused by torch.func transforms).
"""
from __future__ import annotations

import torch

from autosp.errors import AutospError
from autosp.kernels import config
from autosp.kernels._triton import interpreter_problem, triton_available

BACKENDS = ("auto", "triton", "torch")


def fail(op: str, what: str, fix: str):
    raise AutospError(f"autosp.{op}: {what}; {fix}")


def resolve_backend(op: str, backend: str, t: torch.Tensor) -> str:
    """"torch" or "triton" for `t`; raises AutospError when "triton" cannot run here."""
    if backend not in BACKENDS:
        fail(op, f"backend {backend!r} unknown", f"use one of {BACKENDS}")
    if backend == "torch":
        return "torch"
    ok = triton_available() and t.device.type in ("cuda", "cpu")
    if backend == "triton":
        if not ok:
            fail(op, f"backend='triton' on {t.device} without a usable triton", "install triton or use backend='torch'")
        if t.device.type == "cpu" and t.dtype == torch.bfloat16:
            fail(op, "bfloat16 is broken in the Triton interpreter that runs CPU tensors",
                  "use backend='torch' on CPU")
        if t.device.type == "cpu" and interpreter_problem() is not None:
            fail(op, interpreter_problem(), "use backend='torch' on CPU")
        return "triton"
    return "triton" if ok and t.device.type == "cuda" else "torch"


# ---------------------------------------------------------------- the copies


def _copy(dst5: torch.Tensor, src5: torch.Tensor, backend: str) -> None:
    if backend == "torch":
        dst5.copy_(src5)
        return
    from autosp.kernels.a2a_triton import copy5

    d, rows = src5.shape[-1], src5.shape[-2]
    cfg = config.lookup("layout_copy", src5.device, src5.dtype, d, False, rows)
    copy5(dst5, src5, cfg)


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


# ---------------------------------------------------------------- custom ops


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


# Backward = the inverse layout change, through the Function wrappers below so that
# torch.func transforms and double backward work through it too.
def _grads_or_zeros(grads, like):
    return [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype, device) in zip(grads, like)]


def _save_list_shape(ctx, inputs, output):
    xs, world, backend = inputs
    ctx.meta = ([x.shape[1] for x in xs], xs[0].shape[0], xs[0].shape[2], xs[0].shape[3], world, backend)


def _save_buf_args(ctx, inputs, output):
    ctx.meta = inputs[1:]
    ctx.out_like = [(o.shape, o.dtype, o.device) for o in output]  # for the grads of unused outputs


def _pack_heads_bwd(ctx, g):
    heads, b, s, d, world, backend = ctx.meta
    return unpack_heads(g, heads, b, s, d, world, backend), None, None


def _unpack_heads_bwd(ctx, grads):
    head_counts, b, s, d, world, backend = ctx.meta
    return pack_heads(_grads_or_zeros(grads, ctx.out_like), world, backend), \
        None, None, None, None, None, None


def _pack_seq_bwd(ctx, g):
    heads, b, seq, d, world, backend = ctx.meta
    return unpack_seq(g, heads, b, seq // world, d, world, backend), None, None


def _unpack_seq_bwd(ctx, grads):
    heads, b, s, d, world, backend = ctx.meta
    return pack_seq(_grads_or_zeros(grads, ctx.out_like), world, backend), \
        None, None, None, None, None, None


pack_heads_op.register_autograd(_pack_heads_bwd, setup_context=_save_list_shape)
unpack_heads_op.register_autograd(_unpack_heads_bwd, setup_context=_save_buf_args)
pack_seq_op.register_autograd(_pack_seq_bwd, setup_context=_save_list_shape)
unpack_seq_op.register_autograd(_unpack_seq_bwd, setup_context=_save_buf_args)


def _pack_function(op, bwd):
    """An autograd.Function over a pack op (torch.func accepts these, not a custom op's own autograd)."""
    class Pack(torch.autograd.Function):
        @staticmethod
        def forward(world, backend, *xs):
            return op(list(xs), world, backend)

        @staticmethod
        def setup_context(ctx, inputs, output):
            world, backend, *xs = inputs
            _save_list_shape(ctx, (xs, world, backend), output)

        @staticmethod
        def backward(ctx, g):
            return None, None, *bwd(ctx, g)[0]
    return Pack


def _unpack_function(op, bwd):
    class Unpack(torch.autograd.Function):
        @staticmethod
        def forward(buf, counts, b, s, d, world, backend):
            return tuple(op(buf, counts, b, s, d, world, backend))

        setup_context = staticmethod(_save_buf_args)

        @staticmethod
        def backward(ctx, *grads):
            return bwd(ctx, grads)
    return Unpack


_PackHeads = _pack_function(torch.ops.autosp.ulysses_pack_heads, _pack_heads_bwd)
_UnpackHeads = _unpack_function(torch.ops.autosp.ulysses_unpack_heads, _unpack_heads_bwd)
_PackSeq = _pack_function(torch.ops.autosp.ulysses_pack_seq, _pack_seq_bwd)
_UnpackSeq = _unpack_function(torch.ops.autosp.ulysses_unpack_seq, _unpack_seq_bwd)


def _tracks_grad(*tensors) -> bool:
    # autograd.Function.apply costs ~50 us of Python per call (it binds its signature);
    # skip it when no gradient can flow (inference, or buffers that never need one).
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def pack_heads(xs, world: int, backend: str) -> torch.Tensor:
    if _tracks_grad(*xs):
        return _PackHeads.apply(world, backend, *xs)
    return torch.ops.autosp.ulysses_pack_heads(list(xs), world, backend)


def unpack_heads(buf, head_counts, b: int, s: int, d: int, world: int, backend: str) -> list[torch.Tensor]:
    if _tracks_grad(buf):
        return list(_UnpackHeads.apply(buf, list(head_counts), b, s, d, world, backend))
    return torch.ops.autosp.ulysses_unpack_heads(buf, list(head_counts), b, s, d, world, backend)


def pack_seq(xs, world: int, backend: str) -> torch.Tensor:
    if _tracks_grad(*xs):
        return _PackSeq.apply(world, backend, *xs)
    return torch.ops.autosp.ulysses_pack_seq(list(xs), world, backend)


def unpack_seq(buf, heads, b: int, s: int, d: int, world: int, backend: str) -> list[torch.Tensor]:
    if _tracks_grad(buf):
        return list(_UnpackSeq.apply(buf, list(heads), b, s, d, world, backend))
    return torch.ops.autosp.ulysses_unpack_seq(buf, list(heads), b, s, d, world, backend)

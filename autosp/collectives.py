"""Collectives as ops: torch.library custom ops (fake + autograd) over process-group names.

Each is one IR op with a shape function (its fake), so the verifier, lowering and
autograd treat them like any aten op. On CPU they run on gloo; on GPU on NCCL/RCCL.

Gradient convention. A sharded value's grad on rank r is the true grad of its chunk. A replicated
value's grad on rank r is a *share*: the shares of all ranks sum to its true grad. So:
  shard_slice     R -> S   backward: the chunk's grad in place, zeros elsewhere (a share)
  all_gather_seq  S -> R   backward: sum the shares (all-reduce), then this rank's chunk
  all_reduce_sum  P -> R   backward: sum the shares (all-reduce): the true grad of each partial
  all_to_all      S <-> H  backward: the inverse all-to-all
  halo_exchange   S -> S   the `width` positions before this rank's chunk; backward: halo_grad, each
                           position's grad sent back to the rank that holds it and added there
  grad_sync       R -> R   identity forward; backward sums the shares (parameters)
  grad_scale      R -> R   identity forward; backward scales: the outputs' seed becomes a share
A replicated term that reaches the loss without a collective (a weight penalty, a pooled
head on a gathered value) is then counted once, not once per rank.
"""
from __future__ import annotations

import contextlib
import pickle

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group


def _pg(name: str):
    return _resolve_process_group(name)


def group_rank(name: str) -> int:
    return dist.get_rank(_pg(name))


def group_size(name: str) -> int:
    return dist.get_world_size(_pg(name))


# ---------------------------------------------------------------- shard_slice / its backward

def _release(*buffers: Tensor, keep=()) -> None:
    """Free a collective's own buffers now. The backend may hold references to them for a while
    after the call returns (gloo's worker thread does), which would make the step's memory
    depend on thread timing; the data is no longer needed, so the storage goes at once.
    A buffer that shares storage with a tensor in `keep` (an input, an output) is left alone."""
    kept = {t.untyped_storage().data_ptr() for t in keep}
    for b in buffers:
        if b.untyped_storage().data_ptr() not in kept:
            b.untyped_storage().resize_(0)


@contextlib.contextmanager
def _handed(pg, *tensors: Tensor):
    """The tensors to hand a collective: on gloo, aliases of them (the same storage), emptied once it returns.
    gloo's worker thread lets go of a collective's tensors when it gets to it, on busy cores often after the caller
    let go of them too: the worker would free them, at a time set by thread timing (and a free on another thread
    is one the profiler, which measures a CPU step, never records)."""
    if dist.get_backend(pg) != "gloo":
        yield tensors
        return
    # fresh tensors on the same storage: emptying them later touches no version counter of ours
    handles = tuple(t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
                    for t in tensors)
    yield handles
    for h in handles:                    # what the worker still holds is then no storage of ours
        h.set_()


def _split_seq(shape, dim, outer, inner):
    length = shape[dim] // (outer * inner)
    return tuple(shape[:dim]) + (outer, length, inner) + tuple(shape[dim + 1:]), length


def _seq_sized(shape, dim, outer, n, inner) -> list[int]:
    """`shape` with its sequence dim holding n positions (times the merged outer/inner factors)."""
    out = list(shape)
    out[dim] = outer * n * inner
    return out


@torch.library.custom_op("autosp::shard_slice", mutates_args=())
def shard_slice(x: Tensor, dim: int, outer: int, chunk: int, inner: int, group_name: str) -> Tensor:
    """This rank's chunk of a replicated value along its sequence (zero-padded to P * chunk)."""
    split, length = _split_seq(x.shape, dim, outer, inner)
    lo = min(group_rank(group_name) * chunk, length)
    part = x.reshape(split).narrow(dim + 1, lo, min(chunk, length - lo))
    if part.shape[dim + 1] < chunk:
        pad_shape = list(part.shape)
        pad_shape[dim + 1] = chunk - part.shape[dim + 1]
        part = torch.cat([part, part.new_zeros(pad_shape)], dim=dim + 1)
    return part.reshape(_seq_sized(x.shape, dim, outer, chunk, inner)).clone()


@shard_slice.register_fake
def _(x, dim, outer, chunk, inner, group_name):
    return x.new_empty(_seq_sized(x.shape, dim, outer, chunk, inner))


@torch.library.custom_op("autosp::unshard_grad", mutates_args=())
def unshard_grad(g: Tensor, length: int, dim: int, outer: int, chunk: int, inner: int, group_name: str) -> Tensor:
    """The backward of shard_slice: the local grad in place, zeros elsewhere, padding dropped."""
    r, p = group_rank(group_name), group_size(group_name)
    split = list(g.shape[:dim]) + [outer, chunk, inner] + list(g.shape[dim + 1:])
    full = list(split)
    full[dim + 1] = p * chunk
    out = g.new_zeros(full)
    out.narrow(dim + 1, r * chunk, chunk).copy_(g.reshape(split))
    return out.narrow(dim + 1, 0, length).reshape(_seq_sized(g.shape, dim, outer, length, inner))


@unshard_grad.register_fake
def _(g, length, dim, outer, chunk, inner, group_name):
    return g.new_empty(_seq_sized(g.shape, dim, outer, length, inner))


def _shard_slice_setup(ctx, inputs, output):
    x, dim, outer, chunk, inner, group_name = inputs
    ctx.args = (x.shape[dim] // (outer * inner), dim, outer, chunk, inner, group_name)


def _shard_slice_backward(ctx, g):
    return unshard_grad(g, *ctx.args), None, None, None, None, None


shard_slice.register_autograd(_shard_slice_backward, setup_context=_shard_slice_setup)


# ---------------------------------------------------------------- all_reduce_sum

@torch.library.custom_op("autosp::all_reduce_sum", mutates_args=())
def all_reduce_sum(x: Tensor, group_name: str) -> Tensor:
    out = x.clone()
    pg = _pg(group_name)
    with _handed(pg, out) as (h,):
        dist.all_reduce(h, group=pg)
    return out


@all_reduce_sum.register_fake
def _(x, group_name):
    return torch.empty_like(x)


def _all_reduce_setup(ctx, inputs, output):
    ctx.group_name = inputs[1]


all_reduce_sum.register_autograd(lambda ctx, g: (all_reduce_sum(g, ctx.group_name), None),
                                 setup_context=_all_reduce_setup)


# ---------------------------------------------------------------- all_gather_seq

@torch.library.custom_op("autosp::all_gather_seq", mutates_args=())
def all_gather_seq(x: Tensor, length: int, dim: int, outer: int, chunk: int, inner: int, group_name: str) -> Tensor:
    """The global value from every rank's chunk, padding dropped: the exact fallback."""
    p = group_size(group_name)
    pg = _pg(group_name)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(p)]
    if dist.get_backend(pg) == "gloo":
        with _handed(pg, *parts) as handles:
            for w in gloo_gather_rows(handles, x, group_name):
                w.wait()
    else:
        dist.all_gather(parts, x.contiguous(), group=pg)
    split = list(x.shape[:dim]) + [outer, chunk, inner] + list(x.shape[dim + 1:])
    full = torch.cat([t.reshape(split) for t in parts], dim=dim + 1).narrow(dim + 1, 0, length)
    _release(*parts, keep=(x,))
    return full.reshape(_seq_sized(x.shape, dim, outer, length, inner)).contiguous()


@all_gather_seq.register_fake
def _(x, length, dim, outer, chunk, inner, group_name):
    return x.new_empty(_seq_sized(x.shape, dim, outer, length, inner))


def _gather_setup(ctx, inputs, output):
    ctx.args = inputs[2:]


def _gather_backward(ctx, g):
    dim, outer, chunk, inner, group_name = ctx.args
    total = all_reduce_sum(g.contiguous(), group_name)
    return shard_slice(total, dim, outer, chunk, inner, group_name), None, None, None, None, None, None


all_gather_seq.register_autograd(_gather_backward, setup_context=_gather_setup)


# ---------------------------------------------------------------- all_to_all (Ulysses)

def _a2a_shape(shape, scatter_dim, gather_dim, p):
    out = list(shape)
    out[scatter_dim] //= p
    out[gather_dim] *= p
    return out


def a2a_pack(xs: list[Tensor], scatter_dim: int, p: int) -> Tensor:
    """The rank-major send buffer: row r holds, for each x, its r-th slice along scatter_dim."""
    rows = []
    for x in xs:
        shape = list(x.shape)
        split = shape[:scatter_dim] + [p, shape[scatter_dim] // p] + shape[scatter_dim + 1:]
        rows.append(x.reshape(split).movedim(scatter_dim, 0).reshape(p, -1))
    return torch.cat(rows, dim=1).reshape(-1) if len(rows) > 1 else rows[0].contiguous().reshape(-1)


def a2a_unpack(recv: Tensor, shapes: list[list[int]], scatter_dim: int, gather_dim: int, p: int) -> list[Tensor]:
    """Row r of the receive buffer came from rank r: concatenate the rows along gather_dim."""
    sizes, chunks = [], []
    for shape in shapes:
        chunk = list(shape)
        chunk[scatter_dim] //= p
        chunks.append(chunk)
        n = 1
        for d in chunk:
            n *= d
        sizes.append(n)
    outs = []
    for piece, chunk in zip(recv.reshape(p, -1).split(sizes, dim=1), chunks):
        v = piece.reshape([p] + chunk).movedim(0, gather_dim)
        out = list(chunk)
        out[gather_dim] *= p
        t = v.reshape(out)
        if t.untyped_storage().data_ptr() == recv.untyped_storage().data_ptr():
            # a custom op's outputs may not alias each other or its buffers; contiguous, as the fake says
            # (compiled code asserts the fake's strides)
            t = t.clone(memory_format=torch.contiguous_format)
        outs.append(t)
    return outs


@torch.library.custom_op("autosp::all_to_all", mutates_args=())
def all_to_all(xs: list[Tensor], scatter_dim: int, gather_dim: int, group_name: str) -> list[Tensor]:
    """Split each x along scatter_dim over the ranks and gather along gather_dim: one collective.

    With (scatter 1, gather 2) on [b, h, s/P, d] this is Ulysses' `b h (sp s) d -> b (sp h) s d`
    for Q, K and V in one buffer; (2, 1) is the inverse after attention.
    """
    p = group_size(group_name)
    send = a2a_send(xs, scatter_dim, p)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=_pg(group_name))
    outs = a2a_outputs(recv, [list(x.shape) for x in xs], scatter_dim, gather_dim, p)
    _release(send, recv, keep=list(xs) + outs)
    return outs


def _ulysses_layout(shapes: list, scatter_dim: int, gather_dim: int) -> bool:
    """Attention's layouts, which autosp.kernels packs and unpacks fused: Q, K, V [b, h, s/P, d] in one buffer
    (scatter 1, gather 2), or attention's output back (2, 1)."""
    return (all(len(s) == 4 for s in shapes) and (scatter_dim, gather_dim) in ((1, 2), (2, 1))
            and (scatter_dim == 1 or len(shapes) == 1))


def a2a_send(xs: list[Tensor], scatter_dim: int, p: int) -> Tensor:
    """all_to_all's send buffer, rank-major. Attention's layouts through autosp.kernels (the pack writes it
    straight from [b, h, s/P, d], any strides: no permute().contiguous(); Triton on CUDA/ROCm, torch elsewhere)."""
    from autosp import kernels
    if not _ulysses_layout([x.shape for x in xs], scatter_dim, 3 - scatter_dim):
        return a2a_pack(xs, scatter_dim, p)
    return kernels.ulysses_pack(xs, p) if scatter_dim == 1 else kernels.ulysses_pack_out(xs[0], p)


def a2a_outputs(recv: Tensor, shapes: list[list[int]], scatter_dim: int, gather_dim: int, p: int) -> list[Tensor]:
    """all_to_all's outputs from its receive buffer (`shapes`: its inputs'), none a view of it: attention's layouts
    through autosp.kernels (the unpack writes attention's layout), the others by a2a_unpack."""
    from autosp import kernels
    if not _ulysses_layout(shapes, scatter_dim, gather_dim):
        outs = a2a_unpack(recv, shapes, scatter_dim, gather_dim, p)
    elif scatter_dim == 1:                        # b h (sp s) d -> b (sp h) s d, Q K V in one buffer
        b, _, s_loc, d = shapes[0]
        outs = kernels.ulysses_unpack(recv, [s[1] for s in shapes], b, s_loc, d, p)
    else:                                         # b (sp h) s d -> b h (sp s) d, after attention
        b, h_loc, s, d = shapes[0]
        outs = [kernels.ulysses_unpack_out(recv, b, h_loc, s // p, d, p)]
    key = recv.untyped_storage().data_ptr()
    return [o.clone() if o.untyped_storage().data_ptr() == key else o for o in outs]


@all_to_all.register_fake
def _(xs, scatter_dim, gather_dim, group_name):
    # the same strides as the real op (a traced view must be valid on the real output): the
    # inverse Ulysses all-to-all of one [b, h, s, d] tensor writes it stored as [b, s, h, d]
    p = group_size(group_name)
    if len(xs) == 1 and xs[0].ndim == 4 and (scatter_dim, gather_dim) == (2, 1):
        b, h, s, d = _a2a_shape(xs[0].shape, 2, 1, p)
        return [xs[0].new_empty((b, s, h, d)).transpose(1, 2)]
    return [x.new_empty(_a2a_shape(x.shape, scatter_dim, gather_dim, p)) for x in xs]


def _a2a_setup(ctx, inputs, output):
    ctx.args = inputs[1:]


def _a2a_backward(ctx, grads):
    scatter_dim, gather_dim, group_name = ctx.args
    grads = [g.contiguous() for g in grads]
    return all_to_all(grads, gather_dim, scatter_dim, group_name), None, None, None


all_to_all.register_autograd(_a2a_backward, setup_context=_a2a_setup)


# ---------------------------------------------------------------- halo_exchange (short causal convolutions)

def _halo_rows(width: int, n: int, gap: int) -> int:
    """How many of its last positions a rank sends to the rank `gap` places after it: the part of its
    chunk (n positions) that falls in that rank's halo (the `width` positions before the rank's own chunk).
    Past one chunk (width > n) the halo spans several ranks: the nearer ones send whole chunks."""
    return max(0, min(n, width - (gap - 1) * n)) if gap > 0 else 0


def _halo_splits(width: int, n: int, r: int, p: int) -> tuple[list[int], list[int]]:
    """(positions rank r sends to each rank, positions it receives from each) in halo_exchange."""
    return [_halo_rows(width, n, j - r) for j in range(p)], [_halo_rows(width, n, r - q) for q in range(p)]


def _rows(t: Tensor, dim: int) -> Tensor:
    return t.movedim(dim, 0)


def _halo_shape(shape, dim: int, n: int) -> list[int]:
    out = list(shape)
    out[dim] = n
    return out


@torch.library.custom_op("autosp::halo_exchange", mutates_args=())
def halo_exchange(x: Tensor, dim: int, width: int, group_name: str) -> Tensor:
    """The `width` positions along `dim` just before this rank's chunk, from the ranks before it: what a
    causal convolution of receptive field width + 1 reads across the shard edge. Rank 0 (and any part before
    position 0) gets zeros, as the convolution's own padding gives. One all-to-all with uneven splits (gloo and
    NCCL both have it): neighbours only while width <= the chunk, more ranks past it."""
    pg = _pg(group_name)
    r, p, n = dist.get_rank(pg), dist.get_world_size(pg), x.shape[dim]
    sends, recvs = _halo_splits(width, n, r, p)
    rows = _rows(x, dim)
    send = torch.cat([rows[n - k:] for k in sends], dim=0)
    recv = send.new_empty([sum(recvs)] + list(send.shape[1:]))
    dist.all_to_all_single(recv, send, recvs, sends, group=pg)
    out = x.new_zeros(_halo_shape(x.shape, dim, width))
    got = recv.shape[0]                       # min(width, r * n): the ranks before hold fewer positions
    out.narrow(dim, width - got, got).copy_(recv.movedim(0, dim))
    _release(send, recv, keep=(x, out))
    return out


@halo_exchange.register_fake
def _(x, dim, width, group_name):
    return x.new_empty(_halo_shape(x.shape, dim, width))


@torch.library.custom_op("autosp::halo_grad", mutates_args=())
def halo_grad(g: Tensor, dim: int, n: int, group_name: str) -> Tensor:
    """halo_exchange's backward: the grad of each received position goes back to the rank that holds it,
    which adds it to its own chunk's grad (n positions; a position in several ranks' halos gets the sum)."""
    pg = _pg(group_name)
    r, p, width = dist.get_rank(pg), dist.get_world_size(pg), g.shape[dim]
    forward_sends, forward_recvs = _halo_splits(width, n, r, p)
    got = sum(forward_recvs)                  # the zeros before position 0 go nowhere
    send = _rows(g, dim)[width - got:].contiguous()
    recv = send.new_empty([sum(forward_sends)] + list(send.shape[1:]))
    dist.all_to_all_single(recv, send, forward_sends, forward_recvs, group=pg)
    out = g.new_zeros(_halo_shape(g.shape, dim, n))
    rows = _rows(out, dim)
    for k, piece in zip([k for k in forward_sends if k], recv.split([k for k in forward_sends if k], dim=0)):
        rows[n - k:] += piece                 # each later rank's halo ends with this chunk's last k positions
    _release(send, recv, keep=(g, out))
    return out


@halo_grad.register_fake
def _(g, dim, n, group_name):
    return g.new_empty(_halo_shape(g.shape, dim, n))


def _halo_setup(ctx, inputs, output):
    x, dim, _, group_name = inputs
    ctx.args = (dim, x.shape[dim], group_name)


def _halo_backward(ctx, g):
    return halo_grad(g.contiguous(), *ctx.args), None, None, None


def _halo_grad_setup(ctx, inputs, output):
    g, dim, _, group_name = inputs
    ctx.args = (dim, g.shape[dim], group_name)


def _halo_grad_backward(ctx, gg):
    return halo_exchange(gg.contiguous(), *ctx.args), None, None, None


halo_exchange.register_autograd(_halo_backward, setup_context=_halo_setup)
halo_grad.register_autograd(_halo_grad_backward, setup_context=_halo_grad_setup)


# ---------------------------------------------------------------- positions of this rank

@torch.library.custom_op("autosp::local_positions", mutates_args=())
def local_positions(chunk: int, group_name: str, device: torch.device) -> Tensor:
    """Global sequence positions of this rank's chunk: r * chunk + arange(chunk)."""
    return torch.arange(chunk, device=device) + group_rank(group_name) * chunk


@local_positions.register_fake
def _(chunk, group_name, device):
    return torch.empty(chunk, dtype=torch.long, device=device)


# ---------------------------------------------------------------- grad_sync

class _GradSync(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_names):
        ctx.group_names = group_names
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone(memory_format=torch.contiguous_format)   # one copy: all_reduce works in place
        for name in ctx.group_names:
            dist.all_reduce(g, group=_pg(name))
        return g, None


def grad_sync(x: Tensor, group_names: tuple[str, ...]) -> Tensor:
    """Identity whose backward sums the ranks' grad shares of a replicated input over the mesh.

    An autograd.Function rather than a custom op: a custom op may not return an alias,
    and a copy of every parameter per step would cost what the parameters weigh.
    """
    return _GradSync.apply(x, group_names)


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def grad_scale(x: Tensor, factor: float) -> Tensor:
    """Identity whose backward multiplies by `factor`: turns the caller's seed into this rank's share."""
    return _GradScale.apply(x, factor)


# ---------------------------------------------------------------- parameters sharded on dim 0 (FSDP2's layout)

# torch renamed them (the old names warn from 2.13 on); older torch has only the old ones
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_rows(send: Tensor, group_name: str) -> Tensor:
    """Every rank's `send` (the same shape everywhere) concatenated along dim 0, in group rank order."""
    p = group_size(group_name)
    pg = _pg(group_name)
    out = send.new_empty((p * send.shape[0],) + tuple(send.shape[1:]))
    if dist.get_backend(pg) == "gloo":
        with _handed(pg, *out.chunk(p)) as parts:
            for w in gloo_gather_rows(parts, send, group_name):
                w.wait()
        return out
    try:
        _ALL_GATHER(out, send, group=pg)
    except (RuntimeError, NotImplementedError):         # a backend without it: the list form
        dist.all_gather(list(out.chunk(p)), send, group=pg)
    return out


def gloo_gather_rows(parts, send: Tensor, group_name: str) -> list:
    """An all-gather on gloo as one in-place broadcast per rank into its rows (`parts`: the output's chunks, or
    aliases of them), posted; the works to wait. gloo's own all-gather also holds a flat copy of the whole output
    on its worker until it completes: bytes NCCL's does not have and no plan counts."""
    pg = _pg(group_name)
    parts[group_rank(group_name)].copy_(send)
    ranks = dist.get_process_group_ranks(pg)
    return [dist.broadcast(h, ranks[i], group=pg, async_op=True) for i, h in enumerate(parts)]


def _scatter_sum_rows(full: Tensor, group_name: str) -> Tensor:
    """The sum over ranks of `full` (which it may overwrite), this rank's 1/P of its rows (reduce-scatter).
    gloo reduce-scatters by all-reducing a clone of the whole input: all-reducing `full` in place sends the
    same bytes without the clone (the memory model counts `full` and the shard, liveness.WORKSPACE)."""
    p = group_size(group_name)
    pg = _pg(group_name)
    out = full.new_empty((full.shape[0] // p,) + tuple(full.shape[1:]))
    if dist.get_backend(pg) != "gloo":
        try:
            _REDUCE_SCATTER(out, full, group=pg)
            return out
        except (RuntimeError, NotImplementedError):     # a backend without it: all-reduce, keep this rank's rows
            pass
    dist.all_reduce(full, group=pg)
    out.copy_(full.chunk(p)[group_rank(group_name)])
    return out


@torch.library.custom_op("autosp::all_gather_param", mutates_args=())
def all_gather_param(x: Tensor, rows: int, group_name: str, dtype: torch.dtype, reduce_dtype: torch.dtype) -> Tensor:
    """The whole parameter from every rank's shard of its first dim (each padded to the same `chunk`
    rows), cast to the compute dtype before it moves (FSDP2's param_dtype); `rows` drops the padding.
    Backward: the gradient summed over the group in `reduce_dtype`, this rank's rows (reduce-scatter)."""
    full = _gather_rows(x.to(dtype).contiguous(), group_name)
    return full if rows == full.shape[0] else full[:rows].clone()


@all_gather_param.register_fake
def _(x, rows, group_name, dtype, reduce_dtype):
    return x.new_empty((rows,) + tuple(x.shape[1:]), dtype=dtype)


@torch.library.custom_op("autosp::reduce_scatter_param", mutates_args=())
def reduce_scatter_param(g: Tensor, chunk: int, group_name: str, reduce_dtype: torch.dtype,
                         dtype: torch.dtype) -> Tensor:
    """A whole parameter's gradient share -> this rank's `chunk` rows of the sum over the group,
    reduced in `reduce_dtype` and returned in the shard's `dtype`."""
    p = group_size(group_name)
    full = g.new_zeros((p * chunk,) + tuple(g.shape[1:]), dtype=reduce_dtype)
    full[:g.shape[0]].copy_(g)
    out = _scatter_sum_rows(full, group_name)
    _release(full)
    return out if out.dtype == dtype else out.to(dtype)


@reduce_scatter_param.register_fake
def _(g, chunk, group_name, reduce_dtype, dtype):
    return g.new_empty((chunk,) + tuple(g.shape[1:]), dtype=dtype)


def _gather_param_setup(ctx, inputs, output):
    x, _, group_name, _, reduce_dtype = inputs
    ctx.args = (x.shape[0], group_name, reduce_dtype, x.dtype)


def _gather_param_backward(ctx, g):
    return reduce_scatter_param(g.contiguous(), *ctx.args), None, None, None, None


all_gather_param.register_autograd(_gather_param_backward, setup_context=_gather_param_setup)


# ---------------------------------------------------------------- sub-groups of sp: Ulysses x ring

_SUBGROUPS: dict = {}


def ring_groups(sp_ranks: tuple[tuple[int, ...], ...], u: int) -> tuple[str, str]:
    """(all-to-all group, ring group) names of this rank when each sp group of P ranks is split as
    P = U x R: the all-to-all groups are U consecutive sp ranks (together they hold a contiguous
    segment of the sequence), the ring groups the R ranks at the same place in them (ring rank r
    holds segment r). Created once, on every rank in the same order (new_group is collective)."""
    key = (sp_ranks, u)
    world = dist.distributed_c10d._get_default_group()
    # a world torn down and made again (autosp plan's fake worlds, one per verdict) has none of the old groups
    if key not in _SUBGROUPS or _SUBGROUPS[key][0] is not world:
        me, mine = dist.get_rank(), None
        for ranks in sp_ranks:
            r = len(ranks) // u
            ulysses = [dist.new_group(list(ranks[i * u:(i + 1) * u])) for i in range(r)]
            rings = [dist.new_group(list(ranks[j::u])) for j in range(u)]
            if me in ranks:
                at = ranks.index(me)
                mine = (ulysses[at // u].group_name, rings[at % u].group_name)
        _SUBGROUPS[key] = (world, mine)
    return _SUBGROUPS[key][1]


# ---------------------------------------------------------------- Python objects (plans, signatures)

def _object_device(pg) -> torch.device:
    return torch.device("cpu") if dist.get_backend(pg) == "gloo" else torch.device("cuda", torch.cuda.current_device())


def _encoded(obj, dev: torch.device) -> Tensor:
    """obj pickled, as uint8 on `dev` (on CPU the bytes' own buffer: no allocation of torch's)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    return data.to(dev)


def _decoded(data: Tensor):
    return pickle.loads(data.cpu().numpy().tobytes())


def broadcast_object(obj, pg):
    """The group's first rank's `obj` on every rank of process group `pg` (torch's broadcast_object_list for one
    object). Its buffers are torch's allocations freed by this thread, not by gloo's worker: torch's own version
    leaves them to whichever thread lets go last, and a CPU step's measured peak (autosp.memory) would count a
    plan's pickled bytes as live whenever the worker won."""
    dev = _object_device(pg)
    src = dist.get_global_rank(pg, 0)
    first = dist.get_rank(pg) == 0
    data = _encoded(obj, dev) if first else None
    size = torch.tensor([data.numel() if first else 0], dtype=torch.int64, device=dev)
    with _handed(pg, size) as (h,):
        dist.broadcast(h, src=src, group=pg)
    if not first:
        data = torch.empty(int(size), dtype=torch.uint8, device=dev)
    with _handed(pg, data) as (h,):
        dist.broadcast(h, src=src, group=pg)
    return obj if first else _decoded(data)


def broadcast_bytes(data: bytes | None, pg) -> bytes:
    """The group's first rank's `data` on every rank of the gloo group `pg`, held in Python's memory on both sides
    (torch.frombuffer): no allocation of torch's but the 8-byte size, so a CPU step's measured peak (autosp.memory)
    sees none of it."""
    first = dist.get_rank(pg) == 0
    src = dist.get_global_rank(pg, 0)
    size = torch.tensor([len(data) if first else 0], dtype=torch.int64)
    with _handed(pg, size) as (h,):
        dist.broadcast(h, src=src, group=pg)
    buf = bytearray(data) if first else bytearray(int(size))
    if buf:
        with _handed(pg, torch.frombuffer(buf, dtype=torch.uint8)) as (h,):
            dist.broadcast(h, src=src, group=pg)
    return data if first else bytes(buf)


def all_gather_objects(obj, pg) -> list:
    """Every rank's `obj`, in group rank order (torch's all_gather_object, its buffers freed by this thread as in
    broadcast_object)."""
    dev = _object_device(pg)
    p = dist.get_world_size(pg)
    mine = _encoded(obj, dev)
    sizes = torch.empty(p, dtype=torch.int64, device=dev)
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=dev)
    with _handed(pg, size, *sizes.chunk(p)) as (h, *parts):
        dist.all_gather(parts, h, group=pg)
    width = int(sizes.max())
    send = torch.zeros(width, dtype=torch.uint8, device=dev)
    send[:mine.numel()] = mine
    out = torch.empty(p * width, dtype=torch.uint8, device=dev)
    with _handed(pg, send, *out.chunk(p)) as (h, *parts):
        dist.all_gather(parts, h, group=pg)
    return [_decoded(out[i * width:i * width + int(n)]) for i, n in enumerate(sizes.tolist())]

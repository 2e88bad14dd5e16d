"""Collectives in two halves: a start that posts the transfer and returns its buffers, and a wait.

    send, recv = all_to_all_start(xs, 1, 2, group)          # packed and posted (async_op=True)
    ...                                                     # work that does not need the result
    wait_collective([send, recv])                           # the transfer is complete: recv holds it
    outs = all_to_all_unpack(recv, shapes, ndim, 1, 2, group)

The buffers are ordinary values of the program (outputs of the start, inputs of the wait), so the memory model
counts them for as long as they are in flight and the program's lowering frees them after the wait, as it frees
any value after its last use. `wait_collective` declares that it writes its buffers (the transfer lands in them when it
completes): nothing reads them before it, and no compiler drops it or moves a reader above it.
passes/schedule.py splits the blocking collectives of autosp.collectives into these and places them.

The backend's handle of a posted transfer is kept here, keyed by the storage of the buffer it lands in; on gloo
the backend gets aliases of the buffers (autosp.collectives._handed's reason: its worker thread lets go of them
when it gets to it), emptied at the wait.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from autosp.collectives import (_REDUCE_SCATTER, _a2a_shape, _pg, a2a_outputs, a2a_send, gloo_gather_rows, group_rank,
                                group_size)

_POSTED: dict[int, tuple] = {}       # storage of the landing buffer -> (work, handles, finish)


def _key(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _handles(pg, *tensors: Tensor) -> tuple[Tensor, ...]:
    if dist.get_backend(pg) != "gloo":
        return tensors
    return tuple(t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride()) for t in tensors)


def _post(landing: Tensor, work, handed, originals, finish=None) -> None:
    """Keep a posted transfer's handle until its wait; `handed`: what the backend got for `originals` (aliases on
    gloo, emptied at the wait; the tensors themselves elsewhere)."""
    aliases = tuple(h for h, t in zip(handed, originals) if h is not t)
    _POSTED[_key(landing)] = (work, aliases, finish)


class _Works:
    """Several posted transfers waited as one."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()


def in_flight() -> int:
    """How many transfers are posted and not yet waited (0 between steps)."""
    return len(_POSTED)


@torch.library.custom_op("autosp::wait_collective", mutates_args=("bufs",))
def wait_collective(bufs: list[Tensor]) -> None:
    """Complete the transfer whose buffers are `bufs` (its start's outputs; the last one is where it lands)."""
    work, handles, finish = _POSTED.pop(_key(bufs[-1]))
    work.wait()
    for h in handles:
        h.set_()                      # what the backend's thread still holds is then no storage of ours
    if finish is not None:
        finish(bufs)


@wait_collective.register_fake
def _(bufs):
    return None


# ---------------------------------------------------------------- all_to_all

@torch.library.custom_op("autosp::all_to_all_start", mutates_args=())
def all_to_all_start(xs: list[Tensor], scatter_dim: int, gather_dim: int, group_name: str) -> list[Tensor]:
    """autosp.collectives.all_to_all's send buffer packed and posted: [send, recv]."""
    p, pg = group_size(group_name), _pg(group_name)
    send = a2a_send(xs, scatter_dim, p)
    if any(_key(send) == _key(x) for x in xs):
        send = send.clone()           # an op's outputs may not alias its inputs
    recv = torch.empty_like(send)
    hr, hs = _handles(pg, recv, send)
    _post(recv, dist.all_to_all_single(hr, hs, group=pg, async_op=True), (hr, hs), (recv, send))
    return [send, recv]


@all_to_all_start.register_fake
def _(xs, scatter_dim, gather_dim, group_name):
    n = sum(x.numel() for x in xs)
    return [xs[0].new_empty(n), xs[0].new_empty(n)]


@torch.library.custom_op("autosp::all_to_all_unpack", mutates_args=())
def all_to_all_unpack(recv: Tensor, shapes: list[int], ndim: int, scatter_dim: int, gather_dim: int,
                      group_name: str) -> list[Tensor]:
    """The outputs of autosp.collectives.all_to_all from its receive buffer; `shapes`: its inputs' shapes, flat."""
    xs = [shapes[i:i + ndim] for i in range(0, len(shapes), ndim)]
    return a2a_outputs(recv, xs, scatter_dim, gather_dim, group_size(group_name))


@all_to_all_unpack.register_fake
def _(recv, shapes, ndim, scatter_dim, gather_dim, group_name):
    p = group_size(group_name)
    xs = [shapes[i:i + ndim] for i in range(0, len(shapes), ndim)]
    if len(xs) == 1 and ndim == 4 and (scatter_dim, gather_dim) == (2, 1):
        b, h, s, d = _a2a_shape(xs[0], 2, 1, p)
        return [recv.new_empty((b, s, h, d)).transpose(1, 2)]
    return [recv.new_empty(_a2a_shape(s, scatter_dim, gather_dim, p)) for s in xs]


# ---------------------------------------------------------------- parameters sharded on dim 0

@torch.library.custom_op("autosp::all_gather_param_start", mutates_args=())
def all_gather_param_start(x: Tensor, group_name: str, dtype: torch.dtype) -> list[Tensor]:
    """autosp.collectives.all_gather_param posted: [the shard in the compute dtype, every rank's shard]. After the
    wait, the parameter is the second's first rows."""
    p, pg = group_size(group_name), _pg(group_name)
    send = x.to(dtype).contiguous()
    if _key(send) == _key(x):
        send = send.clone()
    out = send.new_empty((p * send.shape[0],) + tuple(send.shape[1:]))
    if dist.get_backend(pg) == "gloo":
        # every rank's shard broadcast into its rows in place (no flat copy of the whole, as NCCL's)
        mine = out.chunk(p)
        parts = _handles(pg, *mine)
        _post(out, _Works(gloo_gather_rows(parts, send, group_name)), parts, mine)
    else:
        _post(out, dist.all_gather_into_tensor(out, send, group=pg, async_op=True), (), ())
    return [send, out]


@all_gather_param_start.register_fake
def _(x, group_name, dtype):
    p = group_size(group_name)
    return [x.new_empty(x.shape, dtype=dtype), x.new_empty((p * x.shape[0],) + tuple(x.shape[1:]), dtype=dtype)]


@torch.library.custom_op("autosp::reduce_scatter_param_start", mutates_args=())
def reduce_scatter_param_start(g: Tensor, chunk: int, group_name: str, reduce_dtype: torch.dtype) -> list[Tensor]:
    """autosp.collectives.reduce_scatter_param posted: [the padded whole gradient, this rank's rows of its sum over
    the group], both in `reduce_dtype`; the second holds the sum after the wait. gloo: the whole is all-reduced in
    place (gloo reduce-scatters by all-reducing a clone) and the wait copies this rank's rows."""
    p, pg = group_size(group_name), _pg(group_name)
    full = g.new_zeros((p * chunk,) + tuple(g.shape[1:]), dtype=reduce_dtype)
    full[:g.shape[0]].copy_(g)
    out = full.new_empty((chunk,) + tuple(g.shape[1:]))
    if dist.get_backend(pg) == "gloo":
        (h,) = _handles(pg, full)
        r = group_rank(group_name)
        _post(out, dist.all_reduce(h, group=pg, async_op=True), (h,), (full,),
              lambda bufs: bufs[1].copy_(bufs[0].chunk(p)[r]))
    else:
        _post(out, _REDUCE_SCATTER(out, full, group=pg, async_op=True), (), ())
    return [full, out]


@reduce_scatter_param_start.register_fake
def _(g, chunk, group_name, reduce_dtype):
    p = group_size(group_name)
    rest = tuple(g.shape[1:])
    return [g.new_empty((p * chunk,) + rest, dtype=reduce_dtype), g.new_empty((chunk,) + rest, dtype=reduce_dtype)]

"""Ring attention over a process group: exact attention when the sequence outgrows one rank's heads.

Ulysses splits heads, so its degree stops at the head count; beyond it the sequence is split
over P = U x R ranks: an all-to-all over U (autosp.collectives.all_to_all) and, over R, the
ring this module owns. Its ops are torch.library custom ops with fakes and autograd:

  autosp::ring_attention(q, k, v, is_causal, scale, valid, zigzag, group_name) -> (out, lse)
  autosp::ring_attention_backward(do, q, k, v, out, lse, is_causal, scale, valid, zigzag,
                                  group_name, dlse=None) -> (dq, dk, dv)
  autosp::zigzag_exchange(x, dim, group_name, inverse) -> x in the other layout

What ring_attention computes. The ring group has R ranks; rank j holds q [b, hq, s, d] and
k, v [b, hkv, s, d] (GQA: hq % hkv == 0, K/V never repeated). The full sequence of length R*s
is the ranks' segments in a fixed order (the layouts below). The result is exactly SDPA over the
full sequence, causal by global position when is_causal, restricted to this rank's queries;
keys at global positions >= valid are padding and never attended to (queries there get finite
values, attending to every valid key they may see). out is [b, hq, s, d] in q's dtype, lse
[b, hq, s] in fp32 (fp64 for fp64 inputs); both contiguous, as are the fakes.

Layouts (`ring_positions` gives the global positions of a rank's s slots):
  contiguous  rank j holds positions [j*s, (j+1)*s): one chunk of s, chunk id j.
  zigzag      s even; the sequence is cut into 2R chunks of s/2 and rank j holds chunks j and
              2R-1-j, in that order. For causal attention every rank then has the same work.
zigzag_exchange turns a contiguous segment (rank j: chunks 2j, 2j+1) into the zigzag layout and
back (inverse=True) with one all_to_all_single; its gradient is the other direction.

Schedule (`ring_schedule`, the plan the op runs). R steps; at step t rank j holds the K/V of
ring rank (j - t) mod R, posts the transfer of that block to rank j+1 (and the receive of the
next from j-1) before computing, so that on CUDA the transfer overlaps the compute. Per pair
(query chunk, key chunk) the block is full where the key chunk lies entirely before the query
chunk, causal on the diagonal, and skipped where it lies entirely after (non-causal: all full).
Padding keys are cut off by narrowing K/V (a chunk of padding only is skipped). Partial
(out, lse) merge by log-sum-exp in fp32 (fp64). With zigzag and causal every rank computes
2 diagonal and 2R-1 full half-chunk blocks; contiguous and causal, rank j computes j+1 blocks.

Backward: dq accumulates locally; the dK/dV of the visiting block accumulate in fp32 (fp64) and
travel the ring with it, so after R steps each rank holds the full dK/dV of its own K/V. Each
block uses the flash identity with the merged lse and the final out (delta = rowsum(do * out)
- dlse), so the per-block kernel is the fused SDPA backward on CPU (torch_backward; the math
path when dlse is given).

Bytes each rank sends (`ring_send_bytes`), ct = fp32 (fp64 for fp64 inputs):
  forward   (R-1) * (k.nbytes + v.nbytes)
  backward  (R-1) * (k.nbytes + v.nbytes) + R * (k.numel() + v.numel()) * ct.itemsize
  zigzag_exchange  at most x.nbytes (the chunks that change rank).

Not done yet: skipping the transfers a causal contiguous ring never uses (rank R-1's sends;
the zigzag layout uses every block, so it would gain nothing there); Triton/flash kernels per
block on GPU (the blocks run torch_forward/torch_backward: the fused SDPA kernel on CPU, the
math path elsewhere); a flop formula for torch.utils.flop_counter (it needs R, which the
shape-only formula does not see); double backward.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from autosp.collectives import _pg, _release
from autosp.kernels._ops import differentiable, fail
from autosp.kernels.flash_torch import lse_dtype, torch_backward, torch_forward


# ---------------------------------------------------------------- layouts and schedule (pure)

def local_chunks(R: int, j: int, zigzag: bool) -> tuple[int, ...]:
    """Global chunk ids of ring rank j's slots: (j, 2R-1-j) of 2R chunks of s/2, or (j,) of R of s."""
    return (j, 2 * R - 1 - j) if zigzag else (j,)


def ring_positions(R: int, j: int, s: int, zigzag: bool) -> Tensor:
    """The global sequence positions of ring rank j's s local positions, in order."""
    c = s // 2 if zigzag else s
    return torch.cat([torch.arange(m * c, (m + 1) * c) for m in local_chunks(R, j, zigzag)])


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    """One partial attention: a query chunk of this rank against a key chunk of the visiting block."""
    q_chunk: int        # global chunk ids
    k_chunk: int
    q_slot: int         # their slots in the local layouts (0, or 1 for zigzag's second chunk)
    k_slot: int
    causal: bool        # diagonal: causal inside the block; otherwise every key is seen


@dataclasses.dataclass(frozen=True, slots=True)
class RingStep:
    source: int                 # ring rank whose K/V this rank holds during the step
    blocks: tuple[Block, ...]   # what it computes with them
    send_to: Optional[int]      # ring rank the K/V go to next (None: the last step sends none)
    recv_from: Optional[int]    # ring rank the next K/V come from


def ring_schedule(R: int, j: int, zigzag: bool, causal: bool) -> tuple[RingStep, ...]:
    """The steps ring rank j runs (the op runs exactly these; padding may skip more blocks)."""
    mine = local_chunks(R, j, zigzag)
    steps = []
    for t in range(R):
        src = (j - t) % R
        blocks = tuple(Block(qc, kc, qs, ks, causal and kc == qc)
                       for qs, qc in enumerate(mine) for ks, kc in enumerate(local_chunks(R, src, zigzag))
                       if not (causal and kc > qc))
        last = t == R - 1
        steps.append(RingStep(src, blocks, None if last else (j + 1) % R, None if last else (j - 1) % R))
    return tuple(steps)


def ring_send_bytes(k: Tensor, v: Tensor, R: int) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends: see the module docstring."""
    kv = k.numel() * k.element_size() + v.numel() * v.element_size()
    return (R - 1) * kv, (R - 1) * kv + R * (k.numel() + v.numel()) * _compute_dtype(k.dtype).itemsize


# ---------------------------------------------------------------- checks

def _shapes(q, k, v) -> str:
    return f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"


def _check(op: str, q, k, v, scale, valid: int, zigzag: bool, R: Optional[int] = None) -> None:
    """Raise AutospError naming the op, the shapes and the fix; R only where the group is known."""
    if not all(isinstance(t, Tensor) and t.dim() == 4 for t in (q, k, v)):
        fail(op, f"{_shapes(q, k, v)}: q, k and v must be 4-D [b, h, s, d]", "pass [b, heads, s, head_dim]")
    (b, hq, s, d), (bk, hkv, sk, dk) = q.shape, k.shape
    if k.shape != v.shape or (bk, sk, dk) != (b, s, d):
        fail(op, f"{_shapes(q, k, v)}: k and v must be [b, hkv, s, d] with q's b, s and d",
             "pass this rank's local q, k and v of the same segment")
    if hkv == 0 or hq % hkv:
        fail(op, f"{_shapes(q, k, v)}: {hq} query heads are not a multiple of {hkv} KV heads",
             "pass KV heads that divide the query heads (GQA)")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        fail(op, f"{_shapes(q, k, v)}: dtypes {q.dtype}, {k.dtype}, {v.dtype} on {q.device}, {k.device}, "
                 f"{v.device}", "pass q, k and v in one dtype on one device")
    if s == 0:
        fail(op, f"{_shapes(q, k, v)}: no local positions", "give every ring rank at least one position")
    if zigzag and s % 2:
        fail(op, f"{_shapes(q, k, v)}: zigzag needs an even local length, got s={s}",
             "pad the sequence to a multiple of 2R, or pass zigzag=False")
    if not isinstance(scale, float) or not scale > 0:
        fail(op, f"{_shapes(q, k, v)}: scale={scale!r}", "pass a positive float, e.g. 1/sqrt(head_dim)")
    if valid < 1 or (R is not None and valid > R * s):
        bound = f"[1, R*s = {R * s}]" if R is not None else ">= 1"
        fail(op, f"{_shapes(q, k, v)}: valid={valid} is not in {bound}",
             "pass the number of real (non-padding) positions of the full sequence")


# ---------------------------------------------------------------- transfers

def _transfer(sends, like, to: int, frm: int, group, tag: int):
    """isend `sends` to ring rank `to` and irecv tensors shaped like `like` from `frm`, one batch;
    each tensor its own tag (two equal-sized tensors to one peer must not be matched crosswise)."""
    recvs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in like]
    dst, src = dist.get_global_rank(group, to), dist.get_global_rank(group, frm)
    ops = [dist.P2POp(dist.isend, t, dst, group, tag + i) for i, t in enumerate(sends)]
    ops += [dist.P2POp(dist.irecv, t, src, group, tag + i) for i, t in enumerate(recvs)]
    return recvs, dist.batch_isend_irecv(ops)


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Chunks:
    """Slot views of a local [b, h, s, ...] tensor and the valid keys of each global chunk."""

    def __init__(self, s: int, zigzag: bool, valid: int):
        self.c, self.valid = (s // 2 if zigzag else s), valid

    def slot(self, t: Tensor, i: int, n: Optional[int] = None) -> Tensor:
        return t.narrow(2, i * self.c, self.c if n is None else n)

    def keys(self, chunk: int) -> int:
        """How many leading keys of a global chunk lie before `valid`."""
        return max(0, min(self.c, self.valid - chunk * self.c))


# ---------------------------------------------------------------- ring_attention: the forward op

def _merge(out: Tensor, lse: Tensor, o: Tensor, l: Tensor) -> None:
    """Fold a partial (o, l) into the running (out, lse) views in place: softmax over the union."""
    new = torch.logaddexp(lse, l)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(o.to(out.dtype) * torch.exp(l - new).unsqueeze(-1))
    lse.copy_(new)


@torch.library.custom_op("autosp::ring_attention", mutates_args=())
def ring_attention_op(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float, valid: int, zigzag: bool,
                      group_name: str) -> tuple[Tensor, Tensor]:
    _check("ring_attention", q, k, v, scale, valid, zigzag)
    group = _pg(group_name)
    R, j = dist.get_world_size(group), dist.get_rank(group)
    _check("ring_attention", q, k, v, scale, valid, zigzag, R)
    ch = _Chunks(q.shape[2], zigzag, valid)
    ct = _compute_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=ct, device=q.device)                    # (b, hq, s, d)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    qs = [ch.slot(q, i).contiguous() for i in range(2 if zigzag else 1)]
    kv = [k.contiguous(), v.contiguous()]
    for step in ring_schedule(R, j, zigzag, is_causal):
        nxt = reqs = None
        if step.send_to is not None:      # posted first: on CUDA it overlaps the blocks below
            nxt, reqs = _transfer(kv, kv, step.send_to, step.recv_from, group, tag=0)
        for blk in step.blocks:
            n = ch.keys(blk.k_chunk)
            if n == 0:
                continue
            o, l = torch_forward(qs[blk.q_slot], *(ch.slot(t, blk.k_slot, n).contiguous() for t in kv),
                                 blk.causal, scale)
            _merge(ch.slot(out, blk.q_slot), lse.narrow(2, blk.q_slot * ch.c, ch.c), o, l)
        if reqs is not None:
            _wait(reqs)
            _release(*kv, keep=(k, v))
            kv = nxt
    return out.to(q.dtype), lse


@ring_attention_op.register_fake
def _ring_attention_fake(q, k, v, is_causal, scale, valid, zigzag, group_name):
    _check("ring_attention", q, k, v, scale, valid, zigzag)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))


# ---------------------------------------------------------------- the backward op

@torch.library.custom_op("autosp::ring_attention_backward", mutates_args=())
def ring_attention_backward_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               is_causal: bool, scale: float, valid: int, zigzag: bool, group_name: str,
                               dlse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    _check("ring_attention_backward", q, k, v, scale, valid, zigzag)
    if do.shape != q.shape or out.shape != q.shape or lse.shape != q.shape[:3] or (
            dlse is not None and dlse.shape != lse.shape):
        fail("ring_attention_backward", f"{_shapes(q, k, v)}, do {list(do.shape)}, out {list(out.shape)}, lse "
             f"{list(lse.shape)}: do and out must be q's shape, lse and dlse [b, hq, s]",
             "pass the forward's outputs unchanged")
    group = _pg(group_name)
    R, j = dist.get_world_size(group), dist.get_rank(group)
    _check("ring_attention_backward", q, k, v, scale, valid, zigzag, R)
    ch = _Chunks(q.shape[2], zigzag, valid)
    ct = _compute_dtype(q.dtype)
    slots = range(2 if zigzag else 1)
    qs, dos, outs = ([ch.slot(t, i).contiguous() for i in slots] for t in (q, do.to(q.dtype), out))
    lses = [lse.narrow(2, i * ch.c, ch.c).contiguous() for i in slots]
    dlses = [None if dlse is None else dlse.narrow(2, i * ch.c, ch.c).contiguous() for i in slots]
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    kv = [k.contiguous(), v.contiguous()]
    dkv = dkv_reqs = None        # the travelling grads of the block held now, once they arrive
    sent: list[Tensor] = []      # grads this rank sent, kept until their transfer completes
    for step in ring_schedule(R, j, zigzag, is_causal):
        nxt = kv_reqs = None
        if step.send_to is not None:
            nxt, kv_reqs = _transfer(kv, kv, step.send_to, step.recv_from, group, tag=0)
        acc = [torch.zeros(t.shape, dtype=ct, device=t.device) for t in kv]     # this rank's share
        for blk in step.blocks:
            n = ch.keys(blk.k_chunk)
            if n == 0:
                continue
            i = blk.q_slot
            g = torch_backward(dos[i], qs[i], *(ch.slot(t, blk.k_slot, n).contiguous() for t in kv), outs[i],
                               lses[i], dlses[i], blk.causal, scale)
            ch.slot(dq, i).add_(g[0])
            for a, gt in zip(acc, g[1:]):
                ch.slot(a, blk.k_slot, n).add_(gt)
        if dkv_reqs is not None:          # the shares of the ranks before, for the block held now
            _wait(dkv_reqs)
            _release(*sent)
            for d, a in zip(dkv, acc):
                d.add_(a)
            _release(*acc)
        else:
            dkv = acc
        if R > 1:                         # on to the next rank; after the last step, home
            sent, (dkv, dkv_reqs) = dkv, _transfer(dkv, dkv, (j + 1) % R, (j - 1) % R, group, tag=2)
        if kv_reqs is not None:
            _wait(kv_reqs)
            _release(*kv, keep=(k, v))
            kv = nxt
    if dkv_reqs is not None:
        _wait(dkv_reqs)
        _release(*sent)
    dk, dv = dkv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@ring_attention_backward_op.register_fake
def _ring_attention_backward_fake(do, q, k, v, out, lse, is_causal, scale, valid, zigzag, group_name, dlse=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _ring_setup(ctx, inputs, output):
    q, k, v, is_causal, scale, valid, zigzag, group_name = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (is_causal, scale, valid, zigzag, group_name)
    ctx.set_materialize_grads(False)      # an unused lse costs nothing


def _ring_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None and dlse is None:
        return None, None, None, None, None, None, None, None
    if dout is None:
        dout = torch.zeros_like(out)
    with torch.no_grad():                 # no double backward
        dq, dk, dv = ring_attention_backward_op(dout, q, k, v, out, lse, *ctx.args, dlse)
    return dq, dk, dv, None, None, None, None, None


ring_attention = differentiable(ring_attention_op, _ring_setup, _ring_backward)
ring_attention.__doc__ = """ring_attention(q, k, v, is_causal, scale, valid, zigzag, group_name) -> (out, lse):
autosp::ring_attention, differentiable in q, k, v (and through lse); see the module docstring."""


# ---------------------------------------------------------------- zigzag_exchange

def _zigzag_home(m: int, R: int) -> tuple[int, int]:
    """(rank, slot) of global chunk m of 2R in the zigzag layout."""
    return (m, 0) if m < R else (2 * R - 1 - m, 1)


def zigzag_routes(R: int, inverse: bool) -> list[tuple[int, int, int, int, int]]:
    """(chunk, src rank, src slot, dst rank, dst slot) for every chunk of 2R: contiguous -> zigzag,
    or back with inverse."""
    routes = []
    for m in range(2 * R):
        a, b = divmod(m, 2), _zigzag_home(m, R)
        routes.append((m, *(b + a if inverse else a + b)))
    return routes


def _check_exchange(x, dim: int) -> int:
    if not isinstance(x, Tensor) or not -x.dim() <= dim < x.dim():
        fail("zigzag_exchange", f"x {list(getattr(x, 'shape', []))}, dim={dim}: no such dim",
             "pass the sequence dim of x")
    dim %= x.dim()
    if x.shape[dim] % 2:
        fail("zigzag_exchange", f"x {list(x.shape)}, dim={dim}: the local length {x.shape[dim]} is odd",
             "pad the sequence to a multiple of 2R")
    return dim


def _splits(rows, R: int, c: int) -> list[int]:
    # rows (peer, chunk, slot) sorted by peer: how many positions go to (come from) each rank
    return [c * sum(1 for peer, *_ in rows if peer == p) for p in range(R)]


@torch.library.custom_op("autosp::zigzag_exchange", mutates_args=())
def zigzag_exchange_op(x: Tensor, dim: int, group_name: str, inverse: bool) -> Tensor:
    """Contiguous segment (rank j: chunks 2j, 2j+1) -> zigzag (chunks j, 2R-1-j), or back: one
    all_to_all_single with per-rank split sizes."""
    dim = _check_exchange(x, dim)
    group = _pg(group_name)
    R, j = dist.get_world_size(group), dist.get_rank(group)
    c = x.shape[dim] // 2
    routes = zigzag_routes(R, inverse)
    outgoing = sorted((dr, m, ss) for m, sr, ss, dr, ds in routes if sr == j)
    incoming = sorted((sr, m, ds) for m, sr, ss, dr, ds in routes if dr == j)
    xm = x.movedim(dim, 0)                                  # (s, ...): chunk slots along dim 0
    send = torch.cat([xm.narrow(0, ss * c, c) for _, _, ss in outgoing])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, _splits(incoming, R, c), _splits(outgoing, R, c), group=group)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for i, (_, _, ds) in enumerate(incoming):
        out.narrow(dim, ds * c, c).copy_(recv.narrow(0, i * c, c).movedim(0, dim))
    _release(send, recv, keep=(x, out))
    return out


@zigzag_exchange_op.register_fake
def _zigzag_exchange_fake(x, dim, group_name, inverse):
    _check_exchange(x, dim)
    return x.new_empty(x.shape)


def _exchange_setup(ctx, inputs, output):
    ctx.args = inputs[1:]


def _exchange_backward(ctx, g):
    dim, group_name, inverse = ctx.args
    return zigzag_exchange(g.contiguous(), dim, group_name, not inverse), None, None, None


zigzag_exchange = differentiable(zigzag_exchange_op, _exchange_setup, _exchange_backward)
zigzag_exchange.__doc__ = """zigzag_exchange(x, dim, group_name, inverse) -> x in the other layout:
autosp::zigzag_exchange, differentiable (its gradient is the inverse exchange)."""

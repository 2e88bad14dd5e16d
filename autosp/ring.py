"""Ring attention over a process group: exact attention when the sequence outgrows one rank's heads.

Ulysses splits heads, so its degree stops at the head count; beyond it the sequence is split
over P = U x R ranks: an all-to-all over U (autosp.collectives.all_to_all) and, over R, the
ring this module owns. Its ops are torch.library custom ops with fakes and autograd:

  autosp::ring_attention(q, k, v, is_causal, scale, valid, zigzag, group_name) -> (out, lse)
  autosp::ring_attention_backward(do, q, k, v, out, lse, is_causal, scale, valid, zigzag,
                                  group_name, dlse=None) -> (dq, dk, dv)
  autosp::ring_masked_attention(q, k, v, is_causal, scale, valid, zigzag, group_name, leaves, mask)
      -> (out, lse)
  autosp::ring_masked_attention_backward(do, q, k, v, out, lse, is_causal, scale, valid, zigzag,
                                         group_name, leaves, mask, dlse=None) -> (dq, dk, dv)
  autosp::zigzag_exchange(x, dim, group_name, inverse) -> x in the other layout

What ring_attention computes. The ring group has R ranks; rank j holds q [b, hq, s, d] and
k, v [b, hkv, s, d] (GQA: hq % hkv == 0, K/V never repeated). The full sequence of length R*s
is the ranks' segments in a fixed order (the layouts below). The result is exactly SDPA over the
full sequence, causal by global position when is_causal, restricted to this rank's queries;
keys at global positions >= valid are padding and never attended to (queries there get finite
values, attending to every valid key they may see). out is [b, hq, s, d] in q's dtype, lse
[b, hq, s] in fp32 (fp64 for fp64 inputs); both contiguous, as are the fakes.

The masked variant also applies `mask`, an expression of autosp/kernels/maskfn.py over global
positions and `leaves` (as autosp::masked_attention takes them: [B or 1, R*s, 1] for xN[q],
[B or 1, 1, R*s] for xN[k], [B or 1, 1, 1], for the whole padded sequence, the same on every rank,
O(b * R*s)). A block is evaluated at its chunks' global positions, so the zigzag order needs no
exchange of leaves. Every block pair runs (is_causal adds the causal cut) unless the mask on it lets
no pair through (evaluated on the block, count_nonzero), then it is skipped; the blocks are the math
path in fp32 (fp64). A row a block masks whole contributes lse -inf and out 0 (the merge is NaN-free);
a row masked everywhere ends with out 0, lse -inf and zero gradients, as masked_attention.

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
  forward   S * (k.nbytes + v.nbytes), S = the K/V sends (R-1 at most; fewer where skipped, below)
  backward  S * (k.nbytes + v.nbytes) + R * (k.numel() + v.numel()) * ct.itemsize
  zigzag_exchange  at most x.nbytes (the chunks that change rank).

K/V travel only while a rank further on the ring needs them (`kv_transfers`): every rank evaluates
which blocks run on every rank (padding, causality, the mask from its replicated leaves) and skips
the sends and receives of blocks no later rank needs; a causal contiguous ring then sends rank j's
block j+1 times instead of R-1 (rank R-1 sends none), a sliding window only as far as it reaches.
The travelling dK/dV still make the whole ring home. Deciding costs R times the mask evaluations of
the blocks a rank runs.

Not done yet: a fused kernel for the masked variant's blocks (the math path materialises one
block's scores); a cost (remat/cost.py) that counts the blocks a mask skips; Triton/flash kernels per
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
from autosp.kernels.masked import _block_mask, _masked_scores, _rows, _unrows
from autosp.kernels.maskfn import check_leaves, parse


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


def kv_transfers(R: int, j: int, needs) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """(send, recv) per step of ring rank j: whether it passes the K/V block it holds on, and whether it
    receives the next. needs[r][o]: ring rank r computes at least one block with the K/V of rank o. A
    block travels only while a rank further on the ring needs it; every rank decides alike from `needs`,
    so a send is skipped exactly where its receive is."""
    def onward(o: int, t: int) -> bool:          # the block of rank o, held at step t: needed later?
        return any(needs[(o + u) % R][o] for u in range(t + 1, R))
    send = tuple(t < R - 1 and onward((j - t) % R, t) for t in range(R))
    recv = tuple(t < R - 1 and onward((j - 1 - t) % R, t) for t in range(R))
    return send, recv


def schedule_needs(R: int, zigzag: bool, causal: bool, runs=None) -> list[list[bool]]:
    """needs[r][o] of `kv_transfers` from the schedules; `runs(r, step, blk)` says whether a block runs
    (padding, a mask), by default every scheduled block."""
    needs = [[False] * R for _ in range(R)]
    for r in range(R):
        for step in ring_schedule(R, r, zigzag, causal):
            if any(runs is None or runs(r, step, blk) for blk in step.blocks):
                needs[r][step.source] = True
    return needs


def ring_send_bytes(k: Tensor, v: Tensor, R: int, j: Optional[int] = None, zigzag: bool = True,
                    causal: bool = True) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends: see the module docstring. With the rank `j`, the K/V
    transfers it skips (a causal contiguous ring: blocks no later rank needs) are not counted."""
    kv = k.numel() * k.element_size() + v.numel() * v.element_size()
    sends = R - 1 if j is None else sum(kv_transfers(R, j, schedule_needs(R, zigzag, causal))[0])
    return sends * kv, sends * kv + R * (k.numel() + v.numel()) * _compute_dtype(k.dtype).itemsize


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
    """isend `sends` to ring rank `to` and irecv tensors shaped like `like` from `frm`, one batch
    (either list may be empty); each tensor its own tag (two equal-sized tensors to one peer must not
    be matched crosswise)."""
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
    shift = new.masked_fill(new == float("-inf"), 0.0)    # rows masked so far: both weights 0, not NaN
    out.mul_(torch.exp(lse - shift).unsqueeze(-1)).add_(o.to(out.dtype) * torch.exp(l - shift).unsqueeze(-1))
    lse.copy_(new)


class _BlockMask:
    """The mask of the masked variant on one block, at the global positions of its chunks."""

    def __init__(self, expr: str, leaves, c: int):
        self.fn, self.leaves, self.c = parse(expr), leaves, c

    def on(self, blk: Block, n: int, device):
        """False: the block lets nothing through (skip it); None: everything; else [B or 1, c, n]."""
        i0, j0 = blk.q_chunk * self.c, blk.k_chunk * self.c
        m = _block_mask(self.fn, self.leaves, i0, i0 + self.c, j0, j0 + n, device)
        if m is False or not blk.causal:
            return m
        seen = torch.ones(self.c, n, dtype=torch.bool, device=device).tril()[None]   # the diagonal block
        if m is None:
            return seen
        return m & seen if m.dtype == torch.bool else m.masked_fill(~seen, float("-inf"))


def _kv_plan(R: int, j: int, zigzag: bool, causal: bool, ch, bm, device):
    """kv_transfers for this call: a block runs where its keys are not all padding and (masked variant)
    the mask lets some pair through; every rank evaluates every rank's blocks alike (the mask's leaves
    are replicated), so senders and receivers agree."""
    def runs(r, step, blk):
        n = ch.keys(blk.k_chunk)
        return n > 0 and (bm is None or bm.on(blk, n, device) is not False)
    return kv_transfers(R, j, schedule_needs(R, zigzag, causal, runs))


def _masked_block_forward(q: Tensor, k: Tensor, v: Tensor, mask, scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse) of one block by the math path, in q's (compute) dtype: q [b, hq, c, d] against
    k, v [b, hkv, n, d] under mask (None or [B or 1, c, n]); a row masked whole gives 0 and -inf."""
    b, hq, _, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    s = _masked_scores(_rows(q, hkv, q.dtype) * scale, k.reshape(b * hkv, n, d), mask, b, hq // hkv)
    lse = torch.logsumexp(s, -1)                                           # (b*hkv, c*g)
    p = s.sub_(lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1)).exp_()
    return _unrows(torch.bmm(p, v.reshape(b * hkv, n, d)), b, hq, q.dtype), _unrows(lse, b, hq, q.dtype)


def _masked_block_backward(rows, k: Tensor, v: Tensor, mask, scale: float, b: int, hq: int):
    """(dq, dk, dv) of one block: P from the merged lse, dS = P * (dO V^T - delta) (flash identity).
    rows = (q * scale, dO, lse with -inf as 0, delta) of the query slot as GQA rows [b*hkv, c*g, ...]."""
    qr, dor, lse, delta = rows
    hkv, n, d = k.shape[1], k.shape[2], k.shape[3]
    kr, vr = k.reshape(b * hkv, n, d), v.reshape(b * hkv, n, d)
    p = _masked_scores(qr, kr, mask, b, hq // hkv, shift=lse).exp_()     # (b*hkv, c*g, n)
    dv = torch.bmm(p.transpose(1, 2), dor)
    ds = torch.baddbmm(delta.neg(), dor, vr.transpose(1, 2)).mul_(p)
    dq = _unrows(torch.bmm(ds, kr).mul_(scale), b, hq, qr.dtype)
    dk = torch.bmm(ds.transpose(1, 2), qr)                                 # qr holds q * scale
    return dq, dk.reshape(k.shape), dv.reshape(v.shape)


def _ring_forward(q, k, v, is_causal, scale, valid, zigzag, group_name, leaves=None, mask=None):
    """Both forward ops: unmasked blocks run the fused kernel, masked ones the math path."""
    op = "ring_attention" if mask is None else "ring_masked_attention"
    _check(op, q, k, v, scale, valid, zigzag)
    group = _pg(group_name)
    R, j = dist.get_world_size(group), dist.get_rank(group)
    _check(op, q, k, v, scale, valid, zigzag, R)
    ch = _Chunks(q.shape[2], zigzag, valid)
    ct = _compute_dtype(q.dtype)
    bm = None if mask is None else _BlockMask(mask, leaves, ch.c)
    out = torch.zeros(q.shape, dtype=ct, device=q.device)                    # (b, hq, s, d)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    qs = [ch.slot(q, i).to(ct if bm else q.dtype).contiguous() for i in range(2 if zigzag else 1)]
    kv = [k.contiguous(), v.contiguous()]
    send, recv = _kv_plan(R, j, zigzag, is_causal, ch, bm, q.device)
    for t, step in enumerate(ring_schedule(R, j, zigzag, is_causal)):
        nxt = reqs = None
        if send[t] or recv[t]:            # posted first: on CUDA it overlaps the blocks below
            nxt, reqs = _transfer(kv if send[t] else [], (k, v) if recv[t] else [], step.send_to, step.recv_from,
                                  group, tag=0)
        for blk in step.blocks if kv is not None else ():
            n = ch.keys(blk.k_chunk)
            if n == 0:
                continue
            kb, vb = (ch.slot(t, blk.k_slot, n).contiguous() for t in kv)
            if bm is None:
                o, l = torch_forward(qs[blk.q_slot], kb, vb, blk.causal, scale)
            else:
                m = bm.on(blk, n, q.device)
                if m is False:
                    continue
                o, l = _masked_block_forward(qs[blk.q_slot], kb.to(ct), vb.to(ct), m, scale)
            _merge(ch.slot(out, blk.q_slot), lse.narrow(2, blk.q_slot * ch.c, ch.c), o, l)
        if reqs is not None:
            _wait(reqs)
        if kv is not None and t < R - 1:
            _release(*kv, keep=(k, v))
        kv = nxt if recv[t] else None
    return out.to(q.dtype), lse


def _ring_backward_impl(do, q, k, v, out, lse, is_causal, scale, valid, zigzag, group_name, dlse,
                        leaves=None, mask=None):
    op = "ring_attention_backward" if mask is None else "ring_masked_attention_backward"
    _check(op, q, k, v, scale, valid, zigzag)
    if do.shape != q.shape or out.shape != q.shape or lse.shape != q.shape[:3] or (
            dlse is not None and dlse.shape != lse.shape):
        fail(op, f"{_shapes(q, k, v)}, do {list(do.shape)}, out {list(out.shape)}, lse "
             f"{list(lse.shape)}: do and out must be q's shape, lse and dlse [b, hq, s]",
             "pass the forward's outputs unchanged")
    group = _pg(group_name)
    R, j = dist.get_world_size(group), dist.get_rank(group)
    _check(op, q, k, v, scale, valid, zigzag, R)
    ch = _Chunks(q.shape[2], zigzag, valid)
    ct = _compute_dtype(q.dtype)
    slots = range(2 if zigzag else 1)
    qs, dos, outs = ([ch.slot(t, i).contiguous() for i in slots] for t in (q, do.to(q.dtype), out))
    lses = [lse.narrow(2, i * ch.c, ch.c).contiguous() for i in slots]
    dlses = [None if dlse is None else dlse.narrow(2, i * ch.c, ch.c).contiguous() for i in slots]
    bm = rows = None
    if mask is not None:
        bm = _BlockMask(mask, leaves, ch.c)
        b, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
        rows = []
        for i in slots:                   # per query slot, once: GQA rows of q * scale, dO, lse, delta
            dor = _rows(dos[i], hkv, ct)
            delta = (dor * _rows(outs[i], hkv, ct)).sum(-1, keepdim=True)
            if dlses[i] is not None:
                delta = delta - _rows(dlses[i][..., None], hkv, ct)
            l = _rows(lses[i][..., None], hkv, ct)
            rows.append((_rows(qs[i], hkv, ct) * scale, dor, l.masked_fill(l == float("-inf"), 0.0), delta))
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    kv = [k.contiguous(), v.contiguous()]
    dkv = dkv_reqs = None        # the travelling grads of the block held now, once they arrive
    sent: list[Tensor] = []      # grads this rank sent, kept until their transfer completes
    send, recv = _kv_plan(R, j, zigzag, is_causal, ch, bm, q.device)
    for t, step in enumerate(ring_schedule(R, j, zigzag, is_causal)):
        nxt = kv_reqs = None
        if send[t] or recv[t]:
            nxt, kv_reqs = _transfer(kv if send[t] else [], (k, v) if recv[t] else [], step.send_to,
                                     step.recv_from, group, tag=0)
        acc = [torch.zeros(x.shape, dtype=ct, device=x.device) for x in (k, v)]    # this rank's share
        for blk in step.blocks if kv is not None else ():
            n = ch.keys(blk.k_chunk)
            if n == 0:
                continue
            i = blk.q_slot
            kb, vb = (ch.slot(t, blk.k_slot, n).contiguous() for t in kv)
            if bm is None:
                g = torch_backward(dos[i], qs[i], kb, vb, outs[i], lses[i], dlses[i], blk.causal, scale)
            else:
                m = bm.on(blk, n, q.device)
                if m is False:
                    continue
                g = _masked_block_backward(rows[i], kb.to(ct), vb.to(ct), m, scale, b, hq)
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
        if kv is not None and t < R - 1:
            _release(*kv, keep=(k, v))
        kv = nxt if recv[t] else None
    if dkv_reqs is not None:
        _wait(dkv_reqs)
        _release(*sent)
    dk, dv = dkv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("autosp::ring_attention", mutates_args=())
def ring_attention_op(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float, valid: int, zigzag: bool,
                      group_name: str) -> tuple[Tensor, Tensor]:
    return _ring_forward(q, k, v, is_causal, scale, valid, zigzag, group_name)


@ring_attention_op.register_fake
def _ring_attention_fake(q, k, v, is_causal, scale, valid, zigzag, group_name):
    _check("ring_attention", q, k, v, scale, valid, zigzag)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("autosp::ring_attention_backward", mutates_args=())
def ring_attention_backward_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               is_causal: bool, scale: float, valid: int, zigzag: bool, group_name: str,
                               dlse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    return _ring_backward_impl(do, q, k, v, out, lse, is_causal, scale, valid, zigzag, group_name, dlse)


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


# ---------------------------------------------------------------- the masked variant

def _check_mask(op: str, q, leaves, mask: str, R: Optional[int] = None) -> None:
    """The leaves against the mask for the whole ring's length R*s. Where R is not known (the fake), the
    length is the leaves' own: then their number, kinds, batch and that they agree are checked."""
    if not isinstance(mask, str) or not isinstance(leaves, (list, tuple)):
        fail(op, f"mask {mask!r}, leaves {type(leaves).__name__}", "pass the mask as a maskfn string and a list "
             "of leaf tensors")
    length = q.shape[2] * R if R is not None else None
    if length is None:
        vecs = [t.shape[1] * t.shape[2] for t in leaves if isinstance(t, Tensor) and t.dim() == 3]
        length = max(vecs) if vecs and max(vecs) > 1 else q.shape[2]
    check_leaves(mask, leaves, length, q.shape[0], q.device, op=f"autosp.{op}: q {list(q.shape)}")


@torch.library.custom_op("autosp::ring_masked_attention", mutates_args=())
def ring_masked_attention_op(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float, valid: int,
                             zigzag: bool, group_name: str, leaves: list[Tensor],
                             mask: str) -> tuple[Tensor, Tensor]:
    R = dist.get_world_size(_pg(group_name))
    _check("ring_masked_attention", q, k, v, scale, valid, zigzag, R)
    _check_mask("ring_masked_attention", q, leaves, mask, R)
    return _ring_forward(q, k, v, is_causal, scale, valid, zigzag, group_name, leaves, mask)


@ring_masked_attention_op.register_fake
def _ring_masked_attention_fake(q, k, v, is_causal, scale, valid, zigzag, group_name, leaves, mask):
    _check("ring_masked_attention", q, k, v, scale, valid, zigzag)
    _check_mask("ring_masked_attention", q, leaves, mask)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("autosp::ring_masked_attention_backward", mutates_args=())
def ring_masked_attention_backward_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                      is_causal: bool, scale: float, valid: int, zigzag: bool, group_name: str,
                                      leaves: list[Tensor], mask: str,
                                      dlse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    return _ring_backward_impl(do, q, k, v, out, lse, is_causal, scale, valid, zigzag, group_name, dlse,
                               leaves, mask)


@ring_masked_attention_backward_op.register_fake
def _ring_masked_attention_backward_fake(do, q, k, v, out, lse, is_causal, scale, valid, zigzag, group_name,
                                         leaves, mask, dlse=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _ring_masked_setup(ctx, inputs, output):
    q, k, v, is_causal, scale, valid, zigzag, group_name, leaves, mask = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *leaves)
    ctx.args = (is_causal, scale, valid, zigzag, group_name)
    ctx.mask = mask
    ctx.set_materialize_grads(False)


def _ring_masked_backward(ctx, dout, dlse):
    q, k, v, out, lse, *leaves = ctx.saved_tensors
    none = (None,) * 5 + ([None] * len(leaves), None)   # the flags, the leaves (ids, positions), the mask
    if dout is None and dlse is None:
        return (None, None, None) + none
    if dout is None:
        dout = torch.zeros_like(out)
    with torch.no_grad():                 # no double backward
        dq, dk, dv = ring_masked_attention_backward_op(dout, q, k, v, out, lse, *ctx.args, leaves, ctx.mask, dlse)
    return (dq, dk, dv) + none


ring_masked_attention = differentiable(ring_masked_attention_op, _ring_masked_setup, _ring_masked_backward)
ring_masked_attention.__doc__ = """ring_masked_attention(q, k, v, is_causal, scale, valid, zigzag, group_name,
leaves, mask) -> (out, lse): autosp::ring_masked_attention, differentiable in q, k, v (and through lse);
see the module docstring."""


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

"""autosp.ring on real gloo processes: ring attention equals SDPA over the full sequence (fp32 rtol 1e-5
relative to the reference's largest entry, every rank), zigzag_exchange is exact, and the schedule's
balance and bytes are what the module docstring says."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from autosp.errors import AutospError
from autosp.ring import ring_attention, ring_attention_op, ring_schedule, zigzag_exchange, zigzag_exchange_op
from tests.dist import run_ranks
from tests.models import assert_every_rank

WORLD = 4          # one pool: R = 4 is the world, R = 2 two rings {0, 1} and {2, 3}, R = 3 ranks 0-2
_RINGS: dict = {}  # per pool process: R -> (group or None, ring index)


def _ring(R):
    """This process's ring of R ranks (None where it is in none); every rank creates every group, in order."""
    import torch.distributed as dist
    if R not in _RINGS:
        if R == dist.get_world_size():
            _RINGS[R] = (dist.group.WORLD, 0)
        else:
            rank, starts = dist.get_rank(), range(0, WORLD - R + 1, R)
            groups = [dist.new_group(list(range(i, i + R))) for i in starts]
            mine = [n for n, i in enumerate(starts) if i <= rank < i + R]
            _RINGS[R] = (groups[mine[0]], mine[0]) if mine else (None, None)
    return _RINGS[R]


# ---------------------------------------------------------------- references on the full sequence

def _data(seed, b, hq, hkv, n, d, valid):
    g = torch.Generator().manual_seed(seed)
    q, w = (torch.randn(b, hq, n, d, generator=g) for _ in range(2))
    k, v = (torch.randn(b, hkv, n, d, generator=g) for _ in range(2))
    wl = torch.randn(b, hq, n, generator=g)
    w[:, :, valid:], wl[:, :, valid:] = 0, 0      # padded query rows take no gradient
    return q, k, v, w, wl


def _math(q, k, v, causal, scale, valid):
    """float64 attention with its lse, keys >= valid masked: the lse reference (and its gradient's)."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    n = q.shape[2]
    sc = q @ k.transpose(-1, -2) * scale
    keys, queries = torch.arange(n)[None, :], torch.arange(n)[:, None]
    keep = (keys < valid) & ((keys <= queries) if causal else True)
    sc = sc.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(sc, -1)
    return torch.exp(sc - lse[..., None]) @ v, lse


def _reference(q, k, v, w, wl, causal, scale, valid, with_lse):
    """out, lse and the grads of sum(out * w) (+ sum(lse * wl)), zero-padded to the full length.
    Without the lse term: SDPA on the valid prefix (GQA by enable_gqa); with it: the float64 math."""
    n = q.shape[2]
    leaves = [t[:, :, :valid].clone().requires_grad_(True) for t in (q, k, v)]
    if with_lse:
        out, lse = _math(*leaves, causal, scale, valid)
        loss = (out * w[:, :, :valid]).sum() + (lse * wl[:, :, :valid]).sum()
    else:
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale, enable_gqa=True)
        loss = (out * w[:, :, :valid]).sum()
    grads = torch.autograd.grad(loss, leaves)
    pad = [F.pad(g.float(), (0, 0, 0, n - valid)) for g in grads]
    return F.pad(out.detach().float(), (0, 0, 0, n - valid)), _math(q, k, v, causal, scale, valid)[1], pad


def _err(got, ref, full_ref) -> float:
    if got.numel() == 0:            # a rank that holds padding only has no real rows to compare
        return 0.0
    return ((got.double() - ref.double()).abs().max() / full_ref.double().abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- the rank jobs

CASES = [dict(causal=c, zigzag=z, heads=h, pad=p, with_lse=False)
         for c, z, h, p in itertools.product((False, True), (False, True), ((4, 2), (2, 1)), (0, 1, 2))]
CASES += [dict(causal=True, zigzag=True, heads=(4, 2), pad=1, with_lse=True),
          dict(causal=False, zigzag=False, heads=(2, 1), pad=2, with_lse=True)]


def _valid(R, s, pad):
    """No padding; padding inside the last chunk (30 of 32 at R=4, s=8); padding over whole chunks."""
    return [R * s, R * s - 2, R * s - s - 3][pad]


def _case_job(rank, world, R, s, cases):
    """Each case on this rank's ring: q, k, v sharded contiguously (zigzag cases go through
    zigzag_exchange and back), forward and autograd grads against the full-sequence reference."""
    from autosp.ring import ring_positions
    group, ring = _ring(R)
    if group is None:
        return {}
    import torch.distributed as dist
    name, j = group.group_name, dist.get_rank(group)
    b, d = 2, 16
    contiguous = ring_positions(R, j, s, False)
    report = {}
    for n, case in enumerate(cases):
        hq, hkv = case["heads"]
        causal, zigzag, valid = case["causal"], case["zigzag"], _valid(R, s, case["pad"])
        scale = 0.3 if n % 2 else 1 / math.sqrt(d)
        q, k, v, w, wl = _data(1000 * ring + n, b, hq, hkv, R * s, d, valid)
        ref_out, ref_lse, ref_grads = _reference(q, k, v, w, wl, causal, scale, valid, case["with_lse"])
        mine = lambda t: t.index_select(2, contiguous)  # noqa: E731
        leaves = [mine(t).requires_grad_(True) for t in (q, k, v)]
        if zigzag:
            zq, zk, zv = (zigzag_exchange(t, 2, name, False) for t in leaves)
            out, lse = ring_attention(zq, zk, zv, causal, scale, valid, True, name)
            out, lse = zigzag_exchange(out, 2, name, True), zigzag_exchange(lse, 2, name, True)
        else:
            out, lse = ring_attention(*leaves, causal, scale, valid, False, name)
        loss = (out * mine(w)).sum() + ((lse * mine(wl)).sum() if case["with_lse"] else 0)
        grads = torch.autograd.grad(loss, leaves)
        rows = contiguous < valid                       # this rank's real query rows
        keys = ~rows                                    # and its padding keys
        errs = {"out": _err(out.detach()[:, :, rows], mine(ref_out)[:, :, rows], ref_out),
                "lse": _err(lse.detach()[:, :, rows], mine(ref_lse)[:, :, rows], ref_lse),
                "finite out, lse": 0.0 if bool(out.isfinite().all() and lse.isfinite().all()) else math.inf,
                "lse fp32": 0.0 if lse.dtype == torch.float32 else math.inf,
                "padding dk, dv zero": 0.0 if all((g[:, :, keys] == 0).all() for g in grads[1:]) else math.inf}
        for t, g, r in zip("qkv", grads, ref_grads):
            errs[f"d{t}"] = _err(g, mine(r), r)
        report[f"R={R} {case} valid={valid}"] = errs
    return report


@pytest.mark.parametrize("R", [2, 3, 4])
def test_ring_attention_matches_sdpa(R):
    """Causal and not, GQA 4/2 and 2/1, padding (in a chunk, over whole chunks), zigzag on and off,
    the lse and its gradient: out, lse, dq, dk, dv on every rank. R = 3 is odd: the zigzag
    exchange sends two chunks to one rank."""
    reports = run_ranks(_case_job, WORLD, R, 8, CASES)
    assert_every_rank([r for r in reports if r], rtol=1e-5)


def _exchange_job(rank, world, R):
    """zigzag_exchange against index_select by ring_positions, on a sequence dim that is not 2,
    both ways, and its gradient (the inverse exchange); all exact."""
    from autosp.ring import ring_positions
    group, ring = _ring(R)
    if group is None:
        return []
    import torch.distributed as dist
    name, j = group.group_name, dist.get_rank(group)
    s = 6
    g = torch.Generator().manual_seed(ring)
    full, seed = torch.randn(3, R * s, 5, generator=g), torch.randn(3, R * s, 5, generator=g)
    contiguous, zig = ring_positions(R, j, s, False), ring_positions(R, j, s, True)
    x = full.index_select(1, contiguous).requires_grad_(True)
    y = zigzag_exchange(x, -2, name, False)
    back = zigzag_exchange(y, 1, name, True)
    (dx,) = torch.autograd.grad((y * seed.index_select(1, zig)).sum(), x)
    bad = []
    if not torch.equal(y, full.index_select(1, zig)):
        bad.append("forward")
    if not torch.equal(back, x):
        bad.append("inverse")
    if not torch.equal(dx, seed.index_select(1, contiguous)):
        bad.append("gradient")
    if not y.is_contiguous():
        bad.append("contiguous")
    return bad


@pytest.mark.parametrize("R", [2, 3, 4])
def test_zigzag_exchange_exact(R):
    for rank, bad in enumerate(run_ranks(_exchange_job, WORLD, R)):
        assert not bad, f"rank {rank}: zigzag_exchange wrong in {bad}"


def _traffic_job(rank, world, zigzag):
    """What the op sends (dist.batch_isend_irecv watched) and the blocks it computes
    (autosp.ring.torch_forward counted), forward and backward, at R = 4; and fake strides."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autosp import ring
    name = dist.group.WORLD.group_name
    b, hq, hkv, s, d = 1, 4, 2, 8, 16
    q = torch.randn(b, s, hq, d).transpose(1, 2).requires_grad_(True)     # strided, as after a projection
    k, v = (torch.randn(b, hkv, s, d, requires_grad=True) for _ in range(2))
    sent, blocks = [], [0]
    batch, forward = dist.batch_isend_irecv, ring.torch_forward

    def watch(ops):
        sent.extend(op.tensor.nbytes for op in ops if op.op is dist.isend)
        return batch(ops)

    def count(*args):
        blocks[0] += 1
        return forward(*args)

    dist.batch_isend_irecv, ring.torch_forward = watch, count
    try:
        out, lse = ring_attention(q, k, v, True, 0.25, 4 * s, zigzag, name)
        fwd = sum(sent)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        bwd = sum(sent) - fwd
    finally:
        dist.batch_isend_irecv, ring.torch_forward = batch, forward
    # torch.func takes the ops too (autosp.passes.autodiff differentiates with it)
    _, vjp = torch.func.vjp(lambda *t: ring_attention(*t, True, 0.25, 4 * s, zigzag, name)[0], q, k, v)
    func_ok = all(torch.equal(a, b) for a, b in zip(vjp(torch.ones_like(out)), grads))
    _, vjp = torch.func.vjp(lambda t: zigzag_exchange(t, 2, name, False), k.detach())
    func_ok = func_ok and torch.equal(vjp(k.detach())[0], zigzag_exchange(k.detach(), 2, name, True))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv = (mode.from_tensor(t.detach()) for t in (q, k, v))
        fake = ring_attention_op(fq, fk, fv, True, 0.25, 4 * s, zigzag, name)
    strides = [(tuple(r.stride()), tuple(f.stride())) for r, f in zip((out, lse), fake)]
    return dict(fwd=fwd, bwd=bwd, expect=ring.ring_send_bytes(k, v, 4, rank, zigzag, True), blocks=blocks[0],
                strides=strides,
                func_ok=func_ok,
                schedule=sum(len(step.blocks) for step in ring_schedule(4, rank, zigzag, True)))


@pytest.mark.parametrize("zigzag", [False, True])
def test_bytes_blocks_and_fake_strides(zigzag):
    for rank, r in enumerate(run_ranks(_traffic_job, WORLD, zigzag)):
        assert (r["fwd"], r["bwd"]) == r["expect"], f"rank {rank}: sent {r['fwd']}, {r['bwd']} != {r['expect']}"
        assert r["blocks"] == r["schedule"], f"rank {rank}: computed {r['blocks']} blocks, schedule {r['schedule']}"
        assert r["func_ok"], f"rank {rank}: torch.func.vjp differs from autograd"
        for real, fake in r["strides"]:
            assert real == fake, f"rank {rank}: fake strides {fake} != real {real}"


def test_zigzag_balances_causal_work():
    """Causal at R = 4: zigzag gives every rank the same blocks (2 diagonal, 2R-1 full); the
    contiguous layout gives rank j j+1 of them."""
    def work(zigzag, j):
        blocks = [blk for step in ring_schedule(4, j, zigzag, True) for blk in step.blocks]
        return len(blocks), sum(0.5 if blk.causal else 1.0 for blk in blocks)

    for i in range(2):          # the count of blocks and their area
        zig = [work(True, j)[i] for j in range(4)]
        assert max(zig) <= 1.05 * min(zig), zig
        plain = [work(False, j)[i] for j in range(4)]
        assert max(plain) > 1.05 * min(plain), plain
    assert [work(True, j)[0] for j in range(4)] == [2 + 2 * 4 - 1] * 4
    assert [work(False, j)[0] for j in range(4)] == [1, 2, 3, 4]
    for j in range(4):          # every rank sees every block once, and the ring closes
        steps = ring_schedule(4, j, True, True)
        assert sorted(step.source for step in steps) == [0, 1, 2, 3]
        assert [step.send_to for step in steps] == [(j + 1) % 4] * 3 + [None]


def test_make_fx_shows_one_forward_and_one_backward_op():
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k, v):
        out, lse = ring_attention(q, k, v, True, 0.25, 30, True, "no group needed to trace")
        return torch.autograd.grad((out * out).sum() + lse.sum(), (q, k, v))

    q = torch.randn(1, 4, 8, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(2))
    gm = make_fx(step, tracing_mode="fake")(q, k, v)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.autosp.ring_attention.default) == 1, gm.code
    assert targets.count(torch.ops.autosp.ring_attention_backward.default) == 1, gm.code


# ---------------------------------------------------------------- errors

def _qkv(hq=4, hkv=2, s=8, d=16):
    return torch.randn(1, hq, s, d), torch.randn(1, hkv, s, d), torch.randn(1, hkv, s, d)


@pytest.mark.parametrize("args, words", [
    ((*_qkv(s=7), True, 0.25, 7, True, "g"), ["ring_attention", "[1, 4, 7, 16]", "even",
                                              "s=7", "zigzag=False"]),
    ((*_qkv(hq=3), True, 0.25, 8, False, "g"), ["3 query heads", "2 KV heads", "divide"]),
    ((_qkv()[0], torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16), True, 0.25, 8, False, "g"),
     ["k [1, 2, 6, 16]", "same segment"]),
    ((*_qkv(), True, 0.25, 0, False, "g"), ["valid=0", "real (non-padding) positions"]),
    ((*_qkv(), True, -1.0, 8, False, "g"), ["scale=-1.0", "positive float"]),
])
def test_ring_attention_errors(args, words):
    with pytest.raises(AutospError) as e:
        ring_attention_op(*args)
    for w in words:
        assert w in str(e.value), str(e.value)
    assert str(e.value).startswith("autosp.ring_attention: ")


def test_errors_in_fake_tracing_and_exchange():
    from torch.fx.experimental.proxy_tensor import make_fx
    q, k, v = _qkv(s=5)
    with pytest.raises(AutospError, match=r"zigzag needs an even local length, got s=5; pad the sequence"):
        make_fx(lambda q, k, v: ring_attention(q, k, v, False, 0.25, 5, True, "g"), tracing_mode="fake")(q, k, v)
    with pytest.raises(AutospError, match=r"autosp.zigzag_exchange: x \[2, 5\], dim=1: the local length 5 is odd; pad"):
        zigzag_exchange_op(torch.randn(2, 5), 1, "g", False)
    with pytest.raises(AutospError, match=r"autosp.zigzag_exchange: x \[2, 4\], dim=2: no such dim; pass the seq"):
        zigzag_exchange_op(torch.randn(2, 4), 2, "g", False)


def _valid_bound_job(rank, world):
    import torch.distributed as dist
    try:
        ring_attention_op(*_qkv(), True, 0.25, 33, False, dist.group.WORLD.group_name)
    except AutospError as e:
        return str(e)
    return "no error"


def test_valid_beyond_the_ring_is_an_error():
    for msg in run_ranks(_valid_bound_job, WORLD):
        assert "valid=33 is not in [1, R*s = 32]" in msg and msg.endswith("positions of the full sequence"), msg


def test_kv_travels_only_while_a_rank_further_on_needs_it():
    """The transfer plan every rank computes alike: a causal contiguous ring of 4 sends rank j's block j + 1
    times (rank 3 none); zigzag needs every block everywhere; a window reaching one chunk back sends each
    block once, to the next rank only. Sends and receives match across the ring."""
    from autosp.ring import kv_transfers, schedule_needs
    R = 4

    def plan(needs):
        plans = [kv_transfers(R, j, needs) for j in range(R)]
        for j in range(R):                       # rank j's send at step t is rank j+1's receive at step t
            assert plans[j][0] == plans[(j + 1) % R][1], (j, plans)
        return [sum(p[0]) for p in plans]

    assert plan(schedule_needs(R, False, True)) == [1, 2, 3, 0]
    assert plan(schedule_needs(R, True, True)) == [3, 3, 3, 3]
    assert plan(schedule_needs(R, False, False)) == [3, 3, 3, 3]
    window = [[r - o in (0, 1) for o in range(R)] for r in range(R)]
    assert plan(window) == [1, 1, 1, 0]

"""`autosp.sequence_op`: an opaque op declared head-parallel along the sequence shards exactly.

The stand-in for a fast kernel is `gated_scan`, a gated linear recurrence written in torch (per head a
decayed causal sum over the sequence, plus a score term `c . c` shared by all heads, as Mamba-2's C . B),
declared with its layouts. A small model (embedding, a linear to q/k/v/gates/c, the declared op, a linear
out, lm head, shifted cross entropy), 2 layers. At sp 2 (s = 45) and sp 4 (s = 50): loss and every grad of
every rank against the single device (fp32, rtol 1e-5); the traced global graph holds the op as one
equation per layer (not its decomposition); each rank's program runs it on its heads over the whole
sequence, with one all-to-all per split input and per output, `c` (no split dim) gathered whole and the
per-head decay `a` cut to the rank's heads. Error paths: bad layouts at declaration, a call whose shapes
do not match, heads that sp does not divide, and the library table without its libraries.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autosp
from tests.dist import run_ranks
from tests.models import assert_every_rank


def gated_scan_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, c: torch.Tensor,
                         a: torch.Tensor) -> torch.Tensor:
    """o[t] = sum_{j <= t} exp(a (G[t] - G[j])) (q[t] . k[j] + c[t] . c[j]) v[j], G = cumsum(g) per head."""
    s = q.shape[1]
    G = torch.cumsum(g * a, dim=1).transpose(1, 2)                        # (b, h, s)
    scores = torch.einsum("bthd,bjhd->bhtj", q, k) + torch.einsum("btn,bjn->btj", c, c)[:, None]
    diff = G[..., :, None] - G[..., None, :]                              # (b, h, t, j)
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(causal, diff, torch.full_like(diff, -float("inf"))).exp()
    return torch.einsum("bhtj,bjhe->bthe", scores * decay, v)            # (b, s, h, dv)


gated_scan = autosp.sequence_op(gated_scan_reference, name="test_gated_scan",
                                layouts="b s h dk, b s h dk, b s h dv, b s h, b s n, h -> b s h dv")


class ScanLM(nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, dk=8, dv=8, n=4, layers=2):
        super().__init__()
        self.heads, self.dk, self.dv, self.n = heads, dk, dv, n
        self.emb = nn.Embedding(vocab, d)
        self.norm = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(d, heads * (2 * dk + dv + 1) + n) for _ in range(layers))
        self.a = nn.ParameterList(nn.Parameter(torch.rand(heads) + 0.5) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(heads * dv, d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        b, s = ids.shape
        h = self.heads
        x = self.emb(ids)                                                  # (b, s, d)
        for norm, proj, a, out in zip(self.norm, self.proj, self.a, self.out):
            q, k, v, g, c = proj(norm(x)).split([h * self.dk, h * self.dk, h * self.dv, h, self.n], dim=-1)
            y = gated_scan(q.view(b, s, h, -1), k.view(b, s, h, -1) * self.dk ** -0.5, v.view(b, s, h, -1),
                           -F.softplus(g), c * 0.5, a)
            x = x + out(y.reshape(b, s, -1))
        return self.head(x)


def _loss(model):
    def loss_fn(params, ids, labels):
        logits = torch.func.functional_call(model, params, (ids,))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    return loss_fn


def _count(graph, name):
    return sum(e.op.name == name for e in graph.eqns)


_PADS = ("narrow", "constant_pad_nd", "pad")      # an uneven length's trim after an all-to-all, its padding before one


def _around(graph, e):
    """The collectives that make each input of `e` and that read its output (through an uneven length's trim
    and padding)."""
    producer, readers, _ = graph.index()

    def made_by(v):
        k = producer.get(v.name)
        while k is not None and graph.eqns[k].op.name in _PADS:
            k = producer.get(graph.eqns[k].inputs[0].name)
        return graph.eqns[k].op.name if k is not None else "input"

    def read_by(v):
        names = []
        for k in readers.get(v.name, ()):
            r = graph.eqns[k]
            names += read_by(r.outputs[0]) if r.op.name in _PADS else [r.op.name]
        return names
    return [made_by(x) for x in e.inputs], read_by(e.outputs[0])


def _job(rank, world, s):
    from torch.distributed.device_mesh import init_device_mesh
    from tests.models import batch, params_of, rank_errors, reference
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    torch.manual_seed(0)
    model = ScanLM()
    fn, params = _loss(model), params_of(model)
    ids, labels = batch(2, s, 64, seed=1, pad=3)
    ref_loss, ref_grads = reference(fn, params, ids, labels)
    vg = autosp.value_and_grad(fn, mesh)
    loss, grads = vg(params, ids, labels)
    (local, *_), = vg.sharded._cache.values()
    ops = [e for e in local.eqns if e.op.name == "autosp_seq.test_gated_scan.default"]
    report = {"errors": rank_errors(loss, grads, ref_loss, ref_grads),
              "ops": len(ops), "op shapes": [[list(x.shape) for x in e.inputs] for e in ops],
              "around": [_around(local, e) for e in ops], "all_to_all": _count(local, "all_to_all")}
    if world == 2:
        report["uneven heads"] = _uneven_heads_error(mesh, s)
    return report


def _uneven_heads_error(mesh, s):
    torch.manual_seed(0)
    model = ScanLM(heads=3, layers=1)
    from tests.models import batch, params_of
    try:
        autosp.shard(_loss(model), mesh)(params_of(model), *batch(2, s, 64))
    except autosp.AutospError as exc:
        return str(exc)
    return None


def _check(reports, world, s):
    assert_every_rank([{"scan lm": r["errors"]} for r in reports])
    h = 4 // world
    for rank, r in enumerate(reports):
        # per layer: q, k, v, g in and the output back (one all-to-all each); c gathered whole; a cut to the heads
        assert r["ops"] == 2 and r["all_to_all"] == 10, (rank, r["ops"], r["all_to_all"])
        for ins, outs in r["around"]:
            assert ins == ["all_to_all"] * 4 + ["all_gather_seq", "shard_slice"] and outs == ["all_to_all"], \
                (rank, ins, outs)
        assert r["op shapes"][0] == [[2, s, h, 8], [2, s, h, 8], [2, s, h, 8], [2, s, h], [2, s, 4], [h]], \
            (rank, r["op shapes"])


def test_sequence_op_sp2_uneven_length():
    reports = run_ranks(_job, 2, 45, timeout=600)
    _check(reports, 2, 45)
    msg = reports[0]["uneven heads"]
    assert msg is not None, "3 heads were split over sp=2"
    for part in ("autosp_seq::test_gated_scan", "test_sequence_op.py", "'h' (3)", "sp=2", "q [2, 45, 3, 8]",
                 "b s h dk, b s h dk, b s h dv, b s h, b s n, h -> b s h dv", "Fix:"):
        assert part in msg, (part, msg)


def test_sequence_op_sp4():
    _check(run_ranks(_job, 4, 50, timeout=600), 4, 50)


# ---------------------------------------------------------------- one device: the op itself and its errors

def _args(s=9, heads=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, s, heads, 8, generator=g), torch.randn(2, s, heads, 8, generator=g),
            torch.randn(2, s, heads, 6, generator=g), -torch.rand(2, s, heads, generator=g),
            torch.randn(2, s, 3, generator=g), torch.rand(heads, generator=g)]


def test_one_equation_and_the_reference_gradient():
    args = [a.requires_grad_() for a in _args()]
    out, ref = gated_scan(*args), gated_scan_reference(*args)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    w = torch.randn_like(ref)
    got = torch.autograd.grad((out * w).sum(), args)
    want = torch.autograd.grad((ref * w).sum(), args)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    # torch.func differentiates it too (what autosp.value_and_grad's callers may use)
    fgot = torch.func.grad(lambda *a: (gated_scan(*a) * w).sum(), argnums=tuple(range(6)))(*args)
    for x, y in zip(fgot, want):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    graph = autosp.trace(lambda *a: gated_scan(*a).sum(), *args)
    names = [e.op.name for e in graph.eqns]
    assert names == ["autosp_seq.test_gated_scan.default", "sum"], names


def test_layouts_fake_and_autograd_backward():
    """fake='layouts' sizes the outputs from the letters; backward='autograd' runs fn under autograd."""
    def scan(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x * w).cumsum(1).transpose(1, 2).contiguous().transpose(1, 2)   # (b, s, h): strides not contiguous
    op = autosp.sequence_op(scan, name="test_cumsum_scan", layouts="b s h, h -> b s h", fake="layouts",
                            backward="autograd")
    x, w = torch.randn(2, 7, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    out = op(x, w)
    assert out.is_contiguous() and torch.equal(out, scan(x, w))
    gx, gw = torch.autograd.grad(out.sum(), (x, w))
    rx, rw = torch.autograd.grad(scan(x, w).sum(), (x, w))
    torch.testing.assert_close((gx, gw), (rx, rw))
    graph = autosp.trace(lambda x, w: op(x, w).sum(), x, w)
    assert [e.op.name for e in graph.eqns] == ["autosp_seq.test_cumsum_scan.default", "sum"]


@pytest.mark.parametrize("layouts, part", [
    ("b s h d -> b s h d", "1 argument layouts for 2 tensor arguments"),
    ("b s h d, h b s h d", "no single '->'"),
    ("b (s h) d, h -> b s h d", "groups or elides dims"),
    ("b s h d, h -> b s d", "lacks the sequence dim 's' or the split dim 'h'"),
    ("b s d, d -> b s d", "no tensor argument has the split dim 'h'"),
    ("b s h d, h -> b s h d, b s h", "2 output layouts for 1 outputs"),
    ("b s h h, h -> b s h d", "duplicate dimension"),
])
def test_bad_layouts(layouts, part):
    def f(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return x
    with pytest.raises(autosp.AutospError) as info:
        autosp.sequence_op(f, layouts=layouts, name="test_bad")
    assert part in str(info.value) and "Fix:" in str(info.value), str(info.value)


def test_shapes_that_do_not_match_the_layouts():
    args = _args()
    with pytest.raises(autosp.AutospError) as info:
        gated_scan(args[0][..., 0], *args[1:])
    msg = str(info.value)
    for part in ("autosp_seq::test_gated_scan", "argument q has shape [2, 9, 4]", "'b s h dk'", "Fix:"):
        assert part in msg, (part, msg)
    with pytest.raises(autosp.AutospError) as info:
        gated_scan(*args[:5], torch.rand(5))
    assert "dim 'h' is 4 in q but 5 in a" in str(info.value), str(info.value)


def test_unannotated_function_and_second_declaration():
    with pytest.raises(autosp.AutospError, match="annotate every argument"):
        autosp.sequence_op(lambda x, a: x, layouts="b s h, h -> b s h", name="test_lambda")
    with pytest.raises(autosp.AutospError, match="declared already"):
        autosp.sequence_op(gated_scan_reference, name="test_gated_scan",
                           layouts="b s h dk, b s h dk, b s h dv, b s h, b s n, h -> b s h dv")

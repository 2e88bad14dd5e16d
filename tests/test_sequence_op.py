"""`autosp.sequence_op`: an opaque op declared head-parallel along the sequence shards exactly.

The stand-in for a fast kernel is `gated_scan`, a gated linear recurrence written in torch (per head a
decayed causal sum over the sequence, plus a score term `c . c` shared by all heads, as Mamba-2's C . B),
declared with its layouts; and flash-linear-attention's gated delta rule as autosp's table declares it
(fake from the layouts, backward by autograd) over a step-by-step torch stand-in. Small models (embedding,
a linear to q/k/v/gates, the declared op, a linear out, lm head, shifted cross entropy), 2 layers. At sp 2
(s = 45), sp 4 (s = 50) and dp 2 x sp 2 (s 45): loss and every grad of every rank against the single
device (fp32, rtol 1e-5); the traced global graph holds the op as one
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
from tests.models import assert_every_rank, shifted_loss


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


# model -> (its op's name, what makes each of the op's inputs on a rank, all-to-alls in the program)
MODELS = {
    "scan lm": ("autosp_seq.test_gated_scan.default", ["all_to_all"] * 4 + ["all_gather_seq", "shard_slice"], 10),
    "delta lm": ("autosp_seq.test_fla_gdr.default", ["all_to_all"] * 5, 12),
}


def _job(rank, world, s):
    from torch.distributed.device_mesh import init_device_mesh
    from tests.models import batch, params_of, rank_errors, reference
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    report = {}
    for name, cls in (("scan lm", ScanLM), ("delta lm", DeltaLM)):
        torch.manual_seed(0)
        model = cls()
        fn, params = shifted_loss(model), params_of(model)
        ids, labels = batch(2, s, 64, seed=1, pad=3)
        ref_loss, ref_grads = reference(fn, params, ids, labels)
        vg = autosp.value_and_grad(fn, mesh)
        loss, grads = vg(params, ids, labels)
        (local, *_), = vg.sharded._cache.values()
        ops = [e for e in local.eqns if e.op.name == MODELS[name][0]]
        report[name] = {"errors": rank_errors(loss, grads, ref_loss, ref_grads),
                        "op shapes": [[list(x.shape) for x in e.inputs] for e in ops],
                        "around": [_around(local, e) for e in ops], "all_to_all": _count(local, "all_to_all")}
    if world == 2:
        report["uneven heads"] = _uneven_heads_error(mesh, s)
    if world == 4:
        report["dp x sp"] = _dp_by_sp(s - 5)
    return report


def _dp_by_sp(s):
    """ScanLM on a 2 x 2 dp x sp mesh, each dp rank its own batch: the mean of the single-device runs."""
    from torch.distributed.device_mesh import init_device_mesh
    from tests.models import batch, params_of, rank_errors, reference
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    torch.manual_seed(0)
    model = ScanLM()
    fn, params = shifted_loss(model), params_of(model)
    batches = [batch(2, s, 64, seed=1 + k, pad=3) for k in range(2)]
    refs = [reference(fn, params, *args) for args in batches]
    loss, grads = autosp.value_and_grad(fn, mesh)(params, *batches[mesh.get_local_rank("dp")])
    return rank_errors(loss, grads, sum(r[0] for r in refs) / 2, {k: (refs[0][1][k] + refs[1][1][k]) / 2 for k in params})


def _uneven_heads_error(mesh, s):
    torch.manual_seed(0)
    model = ScanLM(heads=3, layers=1)
    from tests.models import batch, params_of
    try:
        autosp.shard(shifted_loss(model), mesh)(params_of(model), *batch(2, s, 64))
    except autosp.AutospError as exc:
        return str(exc)
    return None


def _check(reports, world, s):
    assert_every_rank([{name: r[name]["errors"] for name in MODELS} for r in reports])
    if world == 4:
        assert_every_rank([{"scan lm, dp 2 x sp 2, s 45": r["dp x sp"]} for r in reports])
    h = 4 // world
    for rank, report in enumerate(reports):
        for name, (_, ins, to_all) in MODELS.items():
            r = report[name]
            # per layer one equation on this rank's heads over the whole sequence: one all-to-all per split
            # input and one for the output; c (no split dim) gathered whole; the per-head decay cut to the heads
            assert len(r["around"]) == 2 and r["all_to_all"] == to_all, (rank, name, r["around"], r["all_to_all"])
            for got_ins, outs in r["around"]:
                assert got_ins == ins and outs == ["all_to_all"], (rank, name, got_ins, outs)
        assert report["scan lm"]["op shapes"][0] == [[2, s, h, 8], [2, s, h, 8], [2, s, h, 8], [2, s, h], [2, s, 4],
                                                     [h]], (rank, report["scan lm"]["op shapes"])


def test_sequence_op_sp2_uneven_length():
    reports = run_ranks(_job, 2, 45, timeout=600)
    _check(reports, 2, 45)
    msg = reports[0]["uneven heads"]
    assert msg is not None, "3 heads were split over sp=2"
    for part in ("autosp_seq::test_gated_scan", "test_sequence_op.py", "'h' (3)", "sp=2", "q [2, 45, 3, 8]",
                 "b s h dk, b s h dk, b s h dv, b s h, b s n, h -> b s h dv", "Fix:"):
        assert part in msg, (part, msg)


def test_sequence_op_sp4_and_dp_by_sp():
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


# ---------------------------------------------------------------- the library table, with torch stand-ins

def delta_rule_loop(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False):
    """flash-linear-attention's chunk_gated_delta_rule, step by step in torch (its signature, its result):
    S[t] = exp(g[t]) S[t-1] + beta[t] k[t] (v[t] - exp(g[t]) S[t-1]^T k[t])^T, o[t] = scale S[t]^T q[t]."""
    if use_qk_l2norm_in_kernel:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    b, s, h, dk = q.shape
    state = q.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for t in range(s):
        state = state * g[:, t, :, None, None].exp()
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t] * beta[:, t, :, None], err)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t] * scale))
    return torch.stack(outs, dim=1), None


def _stand_in_gdr():
    from autosp.kernels.sequence_ops import TABLE
    entry = next(e for e in TABLE if e.name == "fla.chunk_gated_delta_rule")
    return entry.declare(delta_rule_loop, "test_fla_gdr")


fla_gdr = _stand_in_gdr()


class DeltaLM(nn.Module):
    """Qwen3-Next's gated delta-net layer, shortened, calling the kernel's declared op."""

    def __init__(self, vocab=64, d=32, heads=4, dk=8, layers=2):
        super().__init__()
        self.heads, self.dk = heads, dk
        self.emb = nn.Embedding(vocab, d)
        self.proj = nn.ModuleList(nn.Linear(d, heads * (3 * dk + 2)) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(heads * dk, d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        b, s = ids.shape
        h, dk = self.heads, self.dk
        x = self.emb(ids)
        for proj, out in zip(self.proj, self.out):
            q, k, v, g, beta = proj(x).split([h * dk, h * dk, h * dk, h, h], dim=-1)
            y = fla_gdr(q.view(b, s, h, dk), k.view(b, s, h, dk), v.view(b, s, h, dk), -F.softplus(g),
                        torch.sigmoid(beta), dk ** -0.5, True)
            x = x + out(y.reshape(b, s, -1))
        return self.head(x)


def test_library_table_without_its_libraries():
    from autosp.kernels import sequence_ops
    assert set(sequence_ops.KERNELS) | set(sequence_ops.MISSING) == {e.name for e in sequence_ops.TABLE}
    for name, why in sequence_ops.MISSING.items():
        with pytest.raises(autosp.AutospError) as info:
            sequence_ops.kernel(name)
        entry = next(e for e in sequence_ops.TABLE if e.name == name)
        assert f"pip install {entry.package}" in str(info.value) and "not importable" in str(info.value)
    with pytest.raises(autosp.AutospError, match="declare your own kernel with autosp.sequence_op"):
        sequence_ops.kernel("fla.nothing")


def test_library_wrappers_on_stand_ins():
    """Each wrapper declared over a torch function with the library's signature: one equation, the library
    function's value and gradient (fake from the layouts, backward by the function's own autograd)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 7, 4, 8, generator=g, requires_grad=True) for _ in range(3))
    gate, beta = -torch.rand(2, 7, 4, generator=g), torch.rand(2, 7, 4, generator=g)
    args = (q, k, v, gate.requires_grad_(), beta.requires_grad_())
    out = fla_gdr(*args, 0.3, True)
    ref = delta_rule_loop(*args, scale=0.3, use_qk_l2norm_in_kernel=True)[0]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    w = torch.randn_like(ref)
    for x, y in zip(torch.autograd.grad((out * w).sum(), args), torch.autograd.grad((ref * w).sum(), args)):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    graph = autosp.trace(lambda *a: fla_gdr(*a, 0.3, True).sum(), *args)
    assert [e.op.name for e in graph.eqns] == ["autosp_seq.test_fla_gdr.default", "sum"]

    from autosp.kernels.sequence_ops import TABLE
    conv_entry, scan_entry = (next(e for e in TABLE if e.name.startswith(p)) for p in ("causal_conv1d", "mamba"))

    def conv(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
             final_states_out=None, activation=None):
        y = F.conv1d(x, weight[:, None], bias, padding=weight.shape[-1] - 1, groups=x.shape[1])[..., :x.shape[-1]]
        return F.silu(y) if activation == "silu" else y
    conv_op = conv_entry.declare(conv, "test_causal_conv1d")
    x, cw, cb = torch.randn(2, 6, 9, generator=g), torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    torch.testing.assert_close(conv_op(x, cw, cb, "silu"), conv(x, cw, cb, activation="silu"))

    def scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, 1.0)):
        dt = F.softplus(dt + dt_bias) if dt_softplus else dt + dt_bias
        G = torch.cumsum(dt * A, dim=1).transpose(1, 2)                       # (b, h, s)
        decay = torch.exp(G[..., :, None] - G[..., None, :]).tril()           # (b, h, t, j)
        cb = torch.einsum("btgn,bjgn->btj", C, B)[:, None] * decay
        return torch.einsum("bhtj,bjh,bjhp->bthp", cb, dt, x) + x * D[:, None]
    scan_op = scan_entry.declare(scan, "test_mamba_chunk_scan")
    sx, sdt = torch.randn(2, 7, 4, 3, generator=g), torch.randn(2, 7, 4, generator=g)
    A, B, C = -torch.rand(4, generator=g), torch.randn(2, 7, 1, 5, generator=g), torch.randn(2, 7, 1, 5, generator=g)
    D, bias = torch.randn(4, generator=g), torch.randn(4, generator=g)
    torch.testing.assert_close(scan_op(sx, sdt, A, B, C, D, bias, 4, True),
                               scan(sx, sdt, A, B, C, 4, D=D, dt_bias=bias, dt_softplus=True, dt_limit=(0.0, float("inf"))))
    with pytest.raises(autosp.AutospError, match="repeat B and C to one group per head"):
        scan_op(sx, sdt, A, B.expand(2, 7, 2, 5), C.expand(2, 7, 2, 5), D, bias, 4, True)

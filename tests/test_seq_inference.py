"""The sequence dim without attention, and Llama 4's chunked attention, exact.

Without an attention op to seed from (a model with no attention at all, or attention of its own that is
no head-parallel region, as gpt-oss's sinks joined to the scores), the sharding pass reads the sequence
off the token ids: an integer [b, s] input that feeds an embedding. Llama 4 (tests/zoo.py HF_2026:
a chunked-attention layer with chunks of 8 that cross the shard edges, a NoPE full-attention layer with
temperature tuning, top-1 MoE whose router tiles the tokens with `repeat`) shards with its chunked mask
read as a function, `((k // 8) == (q // 8)) & (k <= q)`, never built s x s.

Every rank against the single device (fp32, rtol 1e-5): sp 2 at s 45 (Llama 4 also with left padding,
where the chunks start after each row's padding), sp 4 at s 50 and a dp 2 x sp 2 mesh at s 50, the
models of a world size in one job.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.dist import run_ranks
from tests.models import assert_every_rank

VOCAB = 64


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class NoAttention(nn.Module):
    """Embedding, residual MLPs behind norms, a final norm and the LM head: nothing mixes positions. A gate of
    bool operators (`&`, `|`, `~` on the ids and on the activations) keeps the positions it allows."""

    def __init__(self, d=32, layers=2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.norms = nn.ModuleList(RMSNorm(d) for _ in range(layers))
        self.ups = nn.ModuleList(nn.Linear(d, 2 * d) for _ in range(layers))
        self.downs = nn.ModuleList(nn.Linear(2 * d, d) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        gate = (((ids // 4) % 3 != 0)[..., None] | (x > 0)) & ~(ids == 1)[..., None]
        x = x * gate.to(x.dtype)
        for norm, up, down in zip(self.norms, self.ups, self.downs):
            x = x + down(F.silu(up(norm(x))))
        return self.head(self.norm(x))


class EagerAttention(nn.Module):
    """Causal attention written out (matmul, mask, softmax, matmul); with `sinks`, gpt-oss's per-head sink
    logit joined to the scores before the softmax and dropped after it."""

    def __init__(self, d=32, heads=4, layers=2, sinks=False):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(VOCAB, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.sinks = nn.ParameterList(nn.Parameter(torch.randn(heads)) for _ in range(layers)) if sinks else None
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids):
        b, s = ids.shape
        x = self.emb(ids)
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
        for i, (qkv, out) in enumerate(zip(self.qkv, self.out)):
            q, k, v = qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)    # (B, nh, T, hs)
            scores = torch.matmul(q, k.transpose(-1, -2)) / q.shape[-1] ** 0.5
            scores = scores.masked_fill(~causal, float("-inf"))
            if self.sinks is not None:
                sink = self.sinks[i].reshape(1, -1, 1, 1).expand(b, -1, s, -1)
                scores = torch.cat([scores, sink], dim=-1)
                probs = F.softmax(scores - scores.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
            else:
                probs = F.softmax(scores, dim=-1)
            x = x + out(torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1))
        return self.head(x)


def shifted_loss(model):
    def loss_fn(params, ids, labels):
        logits = torch.func.functional_call(model, params, (ids,))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
    return loss_fn


def build(name):
    """(loss_fn, params, batch(s, seed)) of a case."""
    from tests.models import batch
    from tests.zoo import case_2026
    plain = lambda s, seed: batch(2, s, VOCAB, seed=seed, pad=3)
    if name == "llama4":
        _, fn, params, *_ = case_2026(name, 8)
        return fn, params, plain
    if name == "llama4_left_padded":       # the chunks start after each row's left padding
        model, _, params, *_ = case_2026("llama4", 8)

        def fn(params, ids, labels, attention_mask):
            return torch.func.functional_call(model, params, (ids,), {"labels": labels, "use_cache": False,
                                                                     "attention_mask": attention_mask}).loss

        def padded(s, seed):
            ids, labels = batch(2, s, VOCAB, seed=seed)
            am = torch.ones(2, s, dtype=torch.long)
            am[1, :5], labels[1, :5] = 0, -100
            return ids, labels, am
        return fn, params, padded
    torch.manual_seed(0)
    model = {"no_attention": NoAttention, "eager": EagerAttention,
             "sinks": lambda: EagerAttention(sinks=True)}[name]()
    return shifted_loss(model), {k: v.detach().clone() for k, v in model.named_parameters()}, plain


def _job(rank, world, s, meshes):
    import autosp
    from torch.distributed.device_mesh import init_device_mesh
    from autosp.api import attention_summary
    from tests.models import rank_errors, reference
    report, summary = {}, {}
    for dims, names in meshes:
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("sp",) if len(dims) == 1 else ("dp", "sp"))
        dp = mesh.get_local_rank("dp") if len(dims) == 2 else 0
        for name in names:
            fn, params, make = build(name)
            batches = [make(s, 1 + i) for i in range(dims[0] if len(dims) == 2 else 1)]
            refs = [reference(fn, params, *bt) for bt in batches]
            ref = sum(r[0] for r in refs) / len(refs)          # dp averages the dp ranks' losses and grads
            ref_grads = {k: sum(r[1][k] for r in refs) / len(refs) for k in params}
            vg = autosp.value_and_grad(fn, mesh)                 # no in_specs: the sequence is inferred
            loss, grads = vg(params, *batches[dp])
            (local, *_), = vg.sharded._cache.values()
            key = f"{name} mesh {dims}"
            report[key] = rank_errors(loss, grads, ref, ref_grads)
            summary[key] = (attention_summary(local, "cpu", dims[-1]),
                            sum(e.op.name == "all_gather_seq" for e in local.eqns))
    return report, summary


@pytest.mark.parametrize("world,s,meshes", [
    (2, 45, [((2,), ["no_attention", "eager", "sinks", "llama4", "llama4_left_padded"])]),
    (4, 50, [((4,), ["no_attention", "sinks", "llama4"]), ((2, 2), ["llama4"])]),
], ids=["sp2-s45", "sp4-s50+dp2xsp2"])
def test_inferred_sequence_and_chunked_attention_exact(world, s, meshes):
    results = run_ranks(_job, world, s, meshes, timeout=1200)
    assert_every_rank([report for report, _ in results])
    for key, (attention, gathers) in results[0][1].items():
        if key.startswith("llama4"):
            # the chunked layer's mask is a function (chunk ids and causal, no s x s tensor); the full one causal
            chunked = ("mask = (((((k - x0) // 8) == ((q - x0) // 8)) & (k <= q)) & x1[k])" if "padded" in key
                       else "mask = (((k // 8) == (q // 8)) & (k <= q)); no s x s tensor")
            assert chunked in attention, attention
            assert "mask materialised" not in attention, attention
            assert gathers == 0, (key, gathers)
        if key.startswith(("no_attention", "eager")):
            assert gathers == 0, (key, gathers)


def test_no_ids_and_no_attention_names_in_specs():
    """Float features and integer labels that feed no embedding: nothing to infer the sequence from."""
    from autosp.errors import ShardError
    from autosp.passes.functionalize import functionalize
    from autosp.passes.shard import shard_graph
    from autosp.passes.shard_ctx import MeshInfo
    from autosp.trace import trace

    def loss_fn(w, feats, labels):
        return F.cross_entropy((feats @ w).reshape(-1, VOCAB), labels.reshape(-1))
    g = functionalize(trace(loss_fn, torch.randn(32, VOCAB), torch.randn(2, 10, 32), torch.randint(0, VOCAB, (2, 10))))
    with pytest.raises(ShardError) as err:
        shard_graph(g, MeshInfo(2, "sp"))
    msg = str(err.value)
    assert "no attention" in msg and "no token ids" in msg and "i64[2,10]" in msg, msg
    assert "Fix: pass in_specs" in msg and "in_specs=(None, 'b s')" in msg, msg


def test_token_ids_seed_through_casts_not_labels_alone():
    """The ids reach the embedding through a cast; labels of the same shape are no seed (they feed no
    embedding) but follow the ids' sequence through the loss's links."""
    from autosp.passes.functionalize import functionalize
    from autosp.passes.seqdims import SeqPos, infer_seq_positions, token_id_seeds
    from autosp.trace import trace
    fn, params, _ = build("no_attention")
    ids = torch.randint(0, VOCAB, (2, 12), dtype=torch.int32)
    labels = torch.randint(0, VOCAB, (2, 12))
    g = functionalize(trace(lambda p, i, l: fn(p, i.long(), l), params, ids, labels))
    seeds = token_id_seeds(g)
    names = {v.name: v for v in g.inputs}
    assert [names[n].dtype for n in seeds] == [torch.int32] and list(seeds.values()) == [SeqPos(1)], seeds
    pos = infer_seq_positions(g, seeds)
    label = next(v for v in g.inputs if v.dtype == torch.int64)
    assert pos.get(label.name) == SeqPos(1), pos.get(label.name)


def test_repeat_tiles_carry_the_sequence():
    """x.repeat(E, 1) over `(b s)` rows (MoE routing) keeps the sequence in dim 0 with E more tiles; a new
    leading dim and an untouched dim link as they are."""
    from autosp.passes.functionalize import functionalize
    from autosp.passes.seqdims import SeqPos, infer_seq_positions
    from autosp.trace import trace

    def f(x):
        rows = x.reshape(-1, 4)
        return rows.repeat(3, 1).sum() + x.repeat(2, 1, 1, 2).sum()
    g = functionalize(trace(f, torch.randn(2, 10, 4)))
    x = g.inputs[0]
    pos = infer_seq_positions(g, {x.name: SeqPos(1)})
    reps = [e for e in g.eqns if e.op.name == "repeat"]
    assert [pos.get(e.outputs[0].name) for e in reps] == [SeqPos(0, 6), SeqPos(2)], [str(e) for e in reps]


def test_chunked_mask_reads_as_chunk_ids():
    """masks.py keeps `pos // chunk` as a division; maskfn evaluates it with torch's floor (negative
    positions included) and refuses a literal 0 divisor; the flash kernels' terms take it as one term."""
    from autosp.errors import AutospError
    from autosp.kernels.maskfn import dense_mask, parse
    from autosp.kernels.maskterms import recognise
    expr = "(((k // 8) == (q // 8)) & (k <= q))"
    n = 21
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    assert torch.equal(dense_mask(expr, [], n)[0], (torch.div(k, 8, rounding_mode="floor")
                                                   == torch.div(q, 8, rounding_mode="floor")) & (k <= q))
    shifted = dense_mask("(q - 3) // 4", [], 6)[0, :, 0]
    assert shifted.tolist() == [-1, -1, -1, 0, 0, 0], shifted
    terms = recognise(expr)
    assert terms is not None and terms.causal and str(terms) == "((q // 8) == (k // 8)) & (-q <= -k)", terms
    with pytest.raises(AutospError, match="divides by the literal 0"):
        parse("k // 0 == q")


def test_chunked_terms_in_the_flash_kernel():
    """The chunked mask with left padding, `((k - x0) // 8) == ((q - x0) // 8)`, causal, padded keys: the
    Triton terms kernel (Triton's interpreter on CPU) against float64 SDPA with the mask written in torch."""
    from autosp.kernels import masked as masked_module
    from autosp.kernels._triton import interpreter_problem
    from autosp.kernels.maskterms import recognise
    if interpreter_problem() is not None and not torch.cuda.is_available():
        pytest.fail(f"Triton interpreter unusable here: {interpreter_problem()}")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    b, h, n, d = 2, 2, 70, 16
    mask = "(((((k - x0) // 8) == ((q - x0) // 8)) & (k <= q)) & x1[k])"
    assert recognise(mask) is not None and recognise(mask).causal
    left = torch.tensor([0, 5]).view(b, 1, 1)
    pos = torch.arange(n)
    keep = (pos[None, :] >= left.view(b, 1)).view(b, 1, n)
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, generator=gen) for _ in range(4))
    qi, ki = pos.view(1, n, 1), pos.view(1, 1, n)
    dense = (torch.div(ki - left, 8, rounding_mode="floor") == torch.div(qi - left, 8, rounding_mode="floor")) \
        & (ki <= qi) & keep
    empty = ~dense.any(-1)                                            # left-padded queries attend nothing
    x64 = [t.double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*x64, attn_mask=dense[:, None] | empty[:, None, :, None])
    ref = ref.masked_fill(empty[:, None, :, None], 0)
    want = (ref, *torch.autograd.grad(ref, x64, do.double()))
    xg = [t.to(dev).requires_grad_() for t in (q, k, v)]
    out, _ = masked_module._differentiable_op(*xg, [left.to(dev), keep.to(dev)], mask, None, n, "triton")
    got = (out, *torch.autograd.grad(out, xg, do.to(dev)))
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, want):
        err = ((a.double().cpu() - r).norm() / r.norm()).item()
        assert err < 1e-5, (name, err)

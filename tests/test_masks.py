"""Masks as functions: packed documents, sliding windows and padding shard exactly with no s x s tensor.

The sharding pass reads a mask built from per-query and per-key vectors back out of the trace as an
expression (autosp/passes/masks.py) and runs `autosp::masked_attention` on those vectors; these tests
hold every rank to the single device (fp32, rtol 1e-5) through HF Llama with packed position_ids,
Mistral's window (smaller and larger than s/P, plain and packed), a hand-written loss with document
ids and causal attention with left padding (fully masked rows), at SP = 2 with a length P does not
divide and SP = 4 with one it does; and they check that no rank's value is s x s.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.dist import run_ranks
from tests.models import assert_every_rank

VOCAB = 64


def packed_positions(lengths: list[int], b: int = 2) -> torch.Tensor:
    """position_ids restarting at each document (transformers' packed-sequence convention); row 1
    has the documents in reverse order, so the batch rows differ."""
    rows = [torch.cat([torch.arange(n) for n in ls]) for ls in (lengths, lengths[::-1])]
    return torch.stack(rows[:b])


def doc_ids(lengths: list[int], b: int = 2) -> torch.Tensor:
    rows = [torch.cat([torch.full((n,), i) for i, n in enumerate(ls)]) for ls in (lengths, lengths[::-1])]
    return torch.stack(rows[:b])


class DocAttention(nn.Module):
    """A hand-written model: attention restricted to each document and to the past, or to the past
    and to the keys a padding vector allows."""

    def __init__(self, d=32, heads=4, layers=2):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(VOCAB, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids, doc=None, keep=None):
        b, s = ids.shape
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
        mask = causal[None]
        if doc is not None:
            mask = mask & (doc[:, :, None] == doc[:, None, :])
        if keep is not None:
            mask = mask & keep[:, None, :].bool()
        x = self.emb(ids)
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
            x = x + out(y.transpose(1, 2).reshape(b, s, -1))
        return self.head(x)


def _cases(s: int, world: int):
    from tests.models import tiny_hf, tiny_llama
    lengths = [1, 5, s // 2 - 4, 1]                 # length-1 documents; the third spans the middle
    rest = s - sum(lengths)
    lengths += [rest - rest // 3, rest // 3]
    assert sum(lengths) == s and min(lengths) >= 1
    pos, docs = packed_positions(lengths), doc_ids(lengths)
    ids = torch.randint(0, VOCAB, (2, s), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :2] = -100

    def hf(model, **kw):
        def loss_fn(params, input_ids, labels, *extra):
            extra = dict(zip(kw, extra))
            return torch.func.functional_call(model, params, (input_ids,),
                                              {"labels": labels, "use_cache": False, **extra}).loss
        return loss_fn

    torch.manual_seed(0)
    llama = tiny_llama()
    torch.manual_seed(0)
    small_window = tiny_hf("mistral", sliding_window=max(2, s // world // 3))
    torch.manual_seed(0)
    big_window = tiny_hf("mistral", sliding_window=s // world + 5)
    torch.manual_seed(0)
    hand = DocAttention()
    keep = torch.ones(2, s, dtype=torch.long)
    keep[1, :5] = 0                                   # left padding: rows 0..4 of batch 1 see no key
    pad_labels = labels.clone()
    pad_labels[1, :5] = -100

    def hand_loss(params, input_ids, labels, doc=None, keep=None):
        logits = torch.func.functional_call(hand, params, (input_ids, doc, keep))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)

    return {
        "llama_packed": (llama, hf(llama, position_ids=1), (ids, labels, pos)),
        "mistral_window_small": (small_window, hf(small_window), (ids, labels)),
        "mistral_window_large_packed": (big_window, hf(big_window, position_ids=1), (ids, labels, pos)),
        "hand_docs": (hand, hand_loss, (ids, labels, docs)),
        "hand_left_padding": (hand, lambda p, i, l, k: hand_loss(p, i, l, None, k), (ids, pad_labels, keep)),
    }


def _square_values(graph, s: int, world: int) -> list[str]:
    sizes = {s, world * math.ceil(s / world)}
    return [e.format() for e in graph.eqns for o in e.outputs
            if o.ndim >= 2 and o.shape[-1] in sizes and o.shape[-2] in sizes]


def _masks_job(rank, world, s):
    import autosp
    from torch.distributed.device_mesh import init_device_mesh
    from tests.models import rank_errors, reference
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    errors, report = {}, {}
    for name, (model, fn, args) in _cases(s, world).items():
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        ref, ref_grads = reference(fn, params, *args)
        vg = autosp.value_and_grad(fn, mesh)
        loss, grads = vg(params, *args)
        errors[name] = rank_errors(loss, grads, ref, ref_grads)
        (local, *_), = vg.sharded._cache.values()
        masked = [e for e in local.eqns if e.op.name == "masked_attention"]
        report[name] = (len(masked), _square_values(local, s, world)[:2],
                        sorted({e.var_args()[0][4] for e in masked}))
        if name == "hand_docs":
            text = autosp.explain(fn, mesh, params, *args)
            report["explain"] = text.split("# attention")[1].split("\n\n")[0]
            if world == 2:                   # the joint program (remat) differentiates the op too
                loss, grads = autosp.value_and_grad(fn, mesh, memory_budget=0.9)(params, *args)
                errors["hand_docs remat"] = rank_errors(loss, grads, ref, ref_grads)
    return errors, report


@pytest.mark.parametrize("world,s", [(2, 45), (4, 48)], ids=["sp2-odd", "sp4-even"])
def test_masks_shard_exactly_without_an_s_by_s_tensor(world, s):
    results = run_ranks(_masks_job, world, s, timeout=900)
    assert_every_rank([errors for errors, _ in results])
    for rank, (_, report) in enumerate(results):
        explained = report.pop("explain")
        assert "mask = ((k <= q) & (x0[q] == x1[k]))" in explained and "no s x s tensor" in explained, \
            (rank, explained)
        bad = {n: r for n, r in report.items() if not (r[0] == 2 and not r[1])}
        assert not bad, f"rank {rank} (masked attentions, s x s values, masks): {bad}"
        assert report["hand_docs"][2] == ["((k <= q) & (x0[q] == x1[k]))"], rank


def _global_masks(fn, *args):
    from autosp.passes.masks import mask_function
    from autosp.passes.shard import input_free
    from autosp.passes.shard_ctx import MeshInfo, ShardCtx
    from autosp.trace import trace
    g = trace(fn, *args)
    ctx = ShardCtx(mesh=MeshInfo(2, "sp"), chunk=1, pos={}, heavy=set(), graph=g, input_free=input_free(g))
    out = []
    for e in g.eqns:
        if e.op.name == "attention":
            mask = e.bind_schema()["attn_mask"]
            q = e.inputs[0]
            fn_ = mask_function(g, mask, q.shape[-2], math.prod(q.shape[:-3]), ctx.constant_value)
            out.append(None if fn_ is None else fn_.expr)
    return out


def test_masks_read_as_functions():
    """What the pass reads out of the trace: the expressions explain prints."""
    s = 12
    cases = _cases(s, 2)
    model, fn, args = cases["mistral_window_small"]
    params = {k: v.detach() for k, v in model.named_parameters()}
    assert set(_global_masks(fn, params, *args)) == {"((k > (q - 2)) & (k <= q))"}
    model, fn, args = cases["llama_packed"]
    params = {k: v.detach() for k, v in model.named_parameters()}
    assert set(_global_masks(fn, params, *args)) == {"((x0[k] <= x1[q]) & (x2[q] == x3[k]))"}
    model, fn, args = cases["hand_left_padding"]
    params = {k: v.detach() for k, v in model.named_parameters()}
    assert set(_global_masks(fn, params, *args)) == {"((k <= q) & x0[k])"}


def test_per_head_mask_stays_a_tensor():
    """A mask with a head dim is not a function of per-query and per-key vectors: None, and explain
    says that it is an O(s^2) tensor."""
    from autosp.api import attention_summary
    from autosp.trace import trace

    def f(x, bias):
        q = x.view(1, 2, 8, 4)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=bias > 0).sum()
    args = torch.randn(1, 8, 8), torch.randn(1, 2, 8, 8)
    assert _global_masks(f, *args) == [None]
    assert "O(s^2) memory per rank" in attention_summary(trace(f, *args), "cpu")


def test_flash_kernel_chosen_only_where_measured_faster(tmp_path, monkeypatch):
    """The sharded program uses autosp's Triton kernel on a GPU only where the GPU check wrote a
    speedup over SDPA above 1 for that device, dtype, head dim, mask and (nearest) length."""
    import json

    from autosp.kernels import config
    path = tmp_path / "cfg.json"
    key = config.cache_key("flash_vs_sdpa", "NVIDIA H200", torch.bfloat16, 128, True, 8192)
    path.write_text(json.dumps({"version": 1, "entries": {key: {"speedup": 1.2}}}))
    monkeypatch.setenv("AUTOSP_KERNEL_CONFIGS", str(path))
    config.reload()
    try:
        assert config.measured_speedup("NVIDIA H200", torch.bfloat16, 128, True, 8192) == 1.2
        assert config.measured_speedup("NVIDIA H200", torch.bfloat16, 128, True, 30000) == 1.2   # nearest length
        assert config.measured_speedup("NVIDIA H200", torch.bfloat16, 128, False, 8192) is None
        assert config.measured_speedup("NVIDIA H100", torch.bfloat16, 128, True, 8192) is None
    finally:
        config.reload()


def test_mask_from_a_parameter_keeps_its_gradient_path():
    """A mask computed from a parameter (a learned per-key bias) needs a gradient through its leaves,
    which masked_attention does not give: it keeps the tensor path (and its gradient)."""
    from autosp.api import Sharded
    from autosp.run.meshes import fake_world, planning_mesh

    def f(w, pb, x, doc):
        q = (x @ w).view(1, 8, 2, 4).transpose(1, 2)
        mask = torch.where(doc[:, :, None] == doc[:, None, :], pb[None, None, :], float("-inf"))
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask[:, None]).sum()

    def g(w, pb, x, doc):
        q = (x @ w).view(1, 8, 2, 4).transpose(1, 2)
        mask = torch.where(doc[:, :, None] == doc[:, None, :], 0.0, float("-inf"))
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask[:, None]).sum()

    args = torch.randn(8, 8), torch.randn(8), torch.randn(1, 8, 8), torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    with fake_world(2):                                   # one process: the pass only needs the group
        ops = [{e.op.name for e in Sharded(fn, planning_mesh(2)).graphs(*args)[1].eqns} for fn in (f, g)]
    assert "masked_attention" not in ops[0] and "attention" in ops[0]
    assert "masked_attention" in ops[1]

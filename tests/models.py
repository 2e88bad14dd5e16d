"""Models the tests trace and shard: an MLP, a small GPT, and HF Llama with a tiny config."""
from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d=16, hidden=32):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """nanoGPT-shaped: learned positions from arange, an explicit boolean causal mask."""

    def __init__(self, vocab=64, d=32, n_head=4, n_layer=2, max_len=512):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device)
        mask = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        x = self.wte(ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def gpt_loss(model):
    """The nanoGPT label shift: logits[:, :-1] against ids[:, 1:]."""
    def loss_fn(params, ids):
        logits = torch.func.functional_call(model, params, (ids,))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
    return loss_fn


def shifted_loss(model):
    """logits[:, :-1] against labels[:, 1:]: a plain module's LM loss, (params, ids, labels)."""
    def loss_fn(params, ids, labels):
        logits = torch.func.functional_call(model, params, (ids,))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    return loss_fn


def tiny_llama(layers=2, vocab=64, hidden=32, heads=4, kv_heads=2, device=None, **extra):
    """use_cache=False makes HF build an explicit [b, 1, s, s] mask and repeat K/V instead."""
    from transformers import LlamaConfig, LlamaForCausalLM
    extra.setdefault("intermediate_size", 2 * hidden)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=4096, attn_implementation="sdpa", **extra)
    if device is None:
        return LlamaForCausalLM(cfg)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def tiny_hf(arch: str, layers=2, vocab=64, hidden=32, heads=4, kv_heads=2, **extra):
    """Another HF causal LM with a tiny config: 'qwen2' (biased QKV), 'mistral' (sliding window)."""
    import transformers
    cfg_cls, model_cls = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                          "mistral": ("MistralConfig", "MistralForCausalLM")}[arch]
    cfg = getattr(transformers, cfg_cls)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        attn_implementation="sdpa", **extra)
    return getattr(transformers, model_cls)(cfg)


def llama_loss(model):
    """HF's own loss: labels shifted inside the model (pad + slice), ignore_index -100."""
    def loss_fn(params, input_ids, labels):
        return torch.func.functional_call(model, params, (input_ids,), {"labels": labels}).loss
    return loss_fn


def params_of(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def batch(b, s, vocab, seed=0, pad=0):
    """Token ids and labels with ignore_index tokens and `pad` right-padded positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[:, : max(1, s // 8)] = -100          # a prompt that is not trained on
    if pad:
        labels[-1, s - pad:] = -100
        ids[-1, s - pad:] = 0
    return ids, labels


# ---------------------------------------------------------------- the single-device oracle

RTOL = 1e-5


def assert_close(got, want, what):
    """Relative to the reference's largest entry: fp32 sums in another order stay within RTOL."""
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
    assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL}"


def reference(fn, params, *args):
    """(loss, grads) of the single-device run; a parameter the loss does not reach gets a zero grad."""
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    loss = fn(p, *args)
    grads = torch.autograd.grad(loss, list(p.values()), allow_unused=True)
    return loss.detach(), {k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(p.items(), grads)}


def rank_errors(loss, grads, ref_loss, ref_grads, floor: float = 0.0) -> dict[str, float]:
    """{tensor: relative error} of one rank's loss and grads against the single device, each relative
    to the reference's largest entry (grads: mappings by name; a None reference grad is skipped).
    A rank returns this, and the parent holds every rank to RTOL with assert_every_rank.

    `floor`: a grad is measured against at least `floor` x the largest entry of any grad. A recurrence's decay
    parameters (A_log, dt_bias) have grads that are sums over every position cancelling to 1e-4 of the others:
    fp32 rounds each term, not the sum, so their relative error is the terms' rounding over the sum's size and
    moves with the CPU's kernels (olmo_hybrid's A_log: 4.2e-6 from float64 on one device, 1.6e-5 sharded, 5e-10
    absolute). With floor 1e-3 a grad that is wrong by more than 1e-8 of the model's largest still fails."""
    ref = float(ref_loss)
    out = {"loss": abs(float(loss) - ref) / max(abs(ref), 1e-12)}
    scale = max((float(g.abs().max()) for g in ref_grads.values() if g is not None and g.numel()),
                default=0.0) if floor else 0.0
    for k, g in ref_grads.items():
        if g is not None:
            den = g.abs().max().clamp_min(max(floor * scale, 1e-12))
            out[f"grad {k}"] = ((grads[k] - g).abs().max() / den).item()
    return out


def assert_every_rank(reports, rtol: float = RTOL) -> None:
    """reports[rank][case] = rank_errors(...): every rank, not rank 0, holds every tensor to rtol;
    a failure names the rank, the case, the tensor and its error (NaN fails too)."""
    assert reports, "no rank reported"
    bad = [f"rank {r} {case}: {t} relative error {e:.2e} > {rtol}"
           for r, report in enumerate(reports) for case, errs in report.items()
           for t, e in errs.items() if not e <= rtol]
    assert not bad, f"{len(bad)} tensors off the single device:\n" + "\n".join(bad[:30])


def assert_peak(predicted: int, measured: int, *, atol: int = 0, rtol: float = 0.0, what: str = "") -> None:
    """The memory model's prediction against the profiler's measured peak: within `atol` bytes or `rtol` of the
    measurement (what the case measures: the exact cases to a few hundred bytes, the ring's to 2 %), and never
    under it by more than 1 % (an under-prediction is a broken promise; an over-prediction only wastes memory)."""
    import os
    off = predicted - measured
    if os.environ.get("AUTOSP_SHOW_PEAKS"):
        print(f"peak {what}: predicted {predicted:,} measured {measured:,} ({off:+,} B, {off / measured:+.2e})")
    assert off >= -0.01 * measured, f"{what}: predicted {predicted:,} B is under the measured {measured:,} B by more than 1 %"
    assert abs(off) <= max(atol, rtol * measured), (
        f"{what}: predicted {predicted:,} B, measured {measured:,} B ({off:+,} B, {off / measured:+.2e}); "
        f"held to {atol} B or {rtol:g} of the measurement")

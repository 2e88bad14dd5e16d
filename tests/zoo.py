"""A zoo of causal LMs nobody here wrote: tiny random configs of transformers' models, and a
Meta-reference-style Llama (complex RoPE) written here. Each entry builds (model, loss_fn).

The configs are tiny but keep each family's features: GQA, sliding windows, softcapping,
partial rotary, parallel attention, biases, tied embeddings, MoE routing, MLA.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 64


def _base(**extra):
    # dropout off everywhere: a sharded run cannot draw the single device's random numbers
    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, attention_dropout=0.0)
    cfg.update(extra)
    return cfg


# name -> (config class, model class, config kwargs)
HF = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _base()),
    "mistral": ("MistralConfig", "MistralForCausalLM", _base(sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _base()),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", _base(head_dim=8)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", _base(head_dim=8)),
    # Gemma2 has no SDPA path in transformers (softcapped scores): its eager attention runs head-parallel
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", _base(head_dim=8, sliding_window=8,
                                                            attn_logit_softcapping=50.0,
                                                            final_logit_softcapping=30.0,
                                                            attn_implementation="eager")),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", _base(head_dim=8, sliding_window=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _base(pad_token_id=0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", _base(rotary_pct=0.5)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=512,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=512,
                                                   rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                         num_attention_heads=4, new_decoder_architecture=False,
                                                         multi_query=True, parallel_attn=True, bias=False,
                                                         hidden_dropout=0.0, attention_dropout=0.0)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", _base(partial_rotary_factor=0.5)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", _base()),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _base()),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", _base(sliding_window=8)),
    "cohere": ("CohereConfig", "CohereForCausalLM", _base()),
    "granite": ("GraniteConfig", "GraniteForCausalLM", _base()),
    # MoE as a user builds it: transformers' default experts kernel (grouped_mm)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", _base(num_local_experts=4, num_experts_per_tok=2,
                                                             output_router_logits=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", _base(num_experts=4, num_experts_per_tok=2,
                                                                  moe_intermediate_size=32,
                                                                  shared_expert_intermediate_size=32)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _base(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
        v_head_dim=8, n_group=1, topk_group=1, num_key_value_heads=4)),
}


_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
               mamba_chunk_size=16)

# 2026's architectures: recurrences (gated delta rule, lightning attention, Mamba-2's SSD, Mamba-1's scan)
# interleaved with attention, attention sinks
HF_2026 = {
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", _base(
        head_dim=8, num_local_experts=4, num_experts_per_tok=2, block_size=16,
        layer_types=["linear_attention", "full_attention"])),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", _base(
        head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], attn_implementation="eager")),
    # chunked attention (layer 0, chunks of 8 cross every shard edge), a NoPE full-attention layer with
    # temperature tuning that varies along the sequence (floor_scale 16), top-1 MoE on layer 1
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", _base(
        head_dim=8, intermediate_size_mlp=64, attention_chunk_size=8, no_rope_layers=[1, 0],
        interleave_moe_layer_step=2, num_local_experts=4, num_experts_per_tok=1, floor_scale=16)),
    # gated delta rule (the torch path: chunks of 64, a state carried between them) after a short conv,
    # with full attention; Qwen3-Next's MoE
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", _base(
        head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"])),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _base(
        head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"])),
    # Mamba-2's SSD (chunks of 16, B and C shared by the heads: read whole) and Mamba-1's scan (a loop over
    # every position), each after a short conv; no attention at all
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=1,
        expand=2, conv_kernel=4, chunk_size=16, attn_implementation="eager")),
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
        attn_implementation="eager")),
    # Mamba-2 interleaved with attention (Bamba, Granite 4 with MoE, Nemotron-H with MLP-only blocks, Falcon-H1
    # with attention and Mamba-2 side by side in each layer), Mamba-1 with attention and MoE (Jamba), KDA
    # (Kimi-Linear, with MLA and MoE), OLMo's gated delta rule hybrid
    "bamba": ("BambaConfig", "BambaForCausalLM", _base(attn_layer_indices=[1], **_MAMBA2)),
    "granite4": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", _base(
        layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32,
        **_MAMBA2)),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, layers_block_type=["mamba", "attention", "mlp"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, ssm_state_size=8, mamba_num_heads=4,
        mamba_head_dim=16, n_groups=1, conv_kernel=4, expand=2, chunk_size=16, max_position_embeddings=512)),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", _base(head_dim=8, mamba_d_ssm=64, **_MAMBA2)),
    "jamba": ("JambaConfig", "JambaForCausalLM", _base(
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
        num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, use_mamba_kernels=False)),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", _base(
        head_dim=8, linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"], kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_layer_types=["dense", "sparse"], num_key_value_heads=4, pad_token_id=0)),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", _base(
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, pad_token_id=0)),
    # LFM2: a depthwise conv1d (kernel conv_L_cache = 3) over `b s c` transposed, sliced to the first s
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", _base(layer_types=["conv", "full_attention"], block_multiple_of=16)),
    # DeepSeek sparse attention: MLA whose mask keeps each query's top 8 keys by a lightweight indexer (2 index
    # heads of 8 over the whole sequence, no grad), a bool mask `&` the causal one; MoE on layer 1
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", _base(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
        v_head_dim=8, n_group=1, topk_group=1, num_key_value_heads=4, index_topk=8, index_head_dim=8,
        index_n_heads=2)),
}


def hf_model(name: str, **extra):
    import transformers
    cfg_cls, model_cls, kw = HF[name] if name in HF else HF_2026[name]
    kw = {**kw, **extra}
    cfg = getattr(transformers, cfg_cls)(attn_implementation=kw.pop("attn_implementation", "sdpa"), **kw)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg)
    return model.float().train()


def hf_loss(model):
    def loss_fn(params, input_ids, labels):
        return torch.func.functional_call(model, params, (input_ids,), {"labels": labels, "use_cache": False}).loss
    return loss_fn


# ---------------------------------------------------------------- a Meta-reference-style Llama

def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MetaBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)
        self.w3 = nn.Linear(dim, 2 * dim, bias=False)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x, freqs_cis):
        bsz, seqlen, _ = x.shape
        h = self.attention_norm(x)
        xq = self.wq(h).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(h).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(h).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        rep = self.n_heads // self.n_kv_heads
        xk = xk.repeat_interleave(rep, dim=2)
        xv = xv.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                             is_causal=True)
        h = x + self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))
        f = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(f)) * self.w3(f))


class MetaLlama(nn.Module):
    """The shape of Meta's reference llama/model.py: complex RoPE, repeat_kv, a mask-free causal SDPA."""

    def __init__(self, vocab=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq=512):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MetaBlock(dim, n_heads, n_kv_heads) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, max_seq), persistent=False)

    def forward(self, tokens):
        _, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[:seqlen]
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h)).float()


def meta_llama_loss(model):
    def loss_fn(params, tokens, labels):
        logits = torch.func.functional_call(model, params, (tokens,))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
    return loss_fn


def build(name: str, **extra):
    """(model, loss_fn) for a zoo entry."""
    if name == "meta_llama":
        torch.manual_seed(0)
        model = MetaLlama(**extra)
        return model, meta_llama_loss(model)
    model = hf_model(name, **extra)
    return model, hf_loss(model)


def case(name: str, s: int):
    """A zoo entry's step at length s: (model, loss_fn, params, (ids, labels), the single device's loss, its grads
    by parameter name) -- the reference every sharded run of the zoo is held to."""
    from tests.models import batch
    model, fn = build(name)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ids, labels = batch(2, s, 64, seed=1, pad=3)
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ref = fn(p, ids, labels)
    ref_grads = dict(zip(params, torch.autograd.grad(ref, list(p.values()), allow_unused=True)))
    return model, fn, params, (ids, labels), ref, ref_grads


NAMES = ["meta_llama"] + list(HF)
NAMES_2026 = list(HF_2026)


case_2026 = case        # an HF_2026 entry's step: hf_model reads both tables
short_conv_model = hf_model

"""Float64 attention, forward and backward, and the error bounds the kernels are held to.

One set for the tests, the autotuner and the GPU check: a kernel (or a tuning candidate)
is compared with float64, never with another kernel.

References:
  attention_f64        the torch backend's math path run in float64, chunked over query rows
                       (memory bounded at any s): real sizes (GPU check, autotuning);
  softmax_attention    the textbook definition, differentiable by autograd, O(s^2) memory:
                       the tests' oracle, independent of the torch backend's code.
Error measures, both relative to the reference's largest entry:
  rel_norm   ||a - ref|| / ||ref||: the overall error, held to TOL[dtype];
  max_err    max |a - ref| / max |ref|: the worst element, so one bad row (a wrong tile, a
             missed rescale) shows even when the norm hides it among s rows. Held to
             SDPA_FACTOR x SDPA's own worst element on the same inputs (as FlashAttention's
             tests do), at least FLOOR[dtype]: `max_err_bounds`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# the project's standard; measured on CPU (Triton interpreter and SDPA), fp16 relative norms are
# 2e-4..5e-4 (9e-4 with logits of a few hundred, test_triton_large_logits)
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float64: 1e-10}
SDPA_FACTOR = 2.0
# fp32: both at rounding level, so the floor keeps the 1e-5 contract
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def attention_f64(q, k, v, causal: bool, scale: float | None = None, do=None):
    """(o, lse) or, with `do`, (o, lse, dq, dk, dv), all float64; q [b, hq, s, d], k/v
    [b, hkv, s, d] (GQA: query head h reads KV head h // (hq // hkv))."""
    from autosp.kernels.flash_torch import math_backward, math_forward
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k, v = (t.detach().double() for t in (q, k, v))
    o, lse = math_forward(q, k, v, causal, scale)
    if do is None:
        return o, lse
    return (o, lse, *math_backward(do.detach().double(), q, k, v, o, lse, None, causal, scale))


def softmax_attention(q, k, v, causal: bool, scale: float | None = None):
    """(out, lse) in float64 by the definition (GQA by repeat_interleave, SDPA's enable_gqa
    convention); differentiable: pass float64 leaves that require grad to get float64 gradients."""
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        n = q.shape[2]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def rel_norm(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref||; absolute where the reference is exactly zero (s=1: dq = dk = 0)."""
    a, ref = a.double(), ref.double()
    denom = ref.norm()
    return ((a - ref).norm() / (denom if denom > 0 else 1)).item()


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|: the worst element, relative to the tensor's scale."""
    a, ref = a.double(), ref.double()
    denom = ref.abs().max()
    return ((a - ref).abs().max() / (denom if denom > 0 else 1)).item()


def sdpa_max_errs(q, k, v, dout, causal: bool, scale: float | None, ref) -> dict[str, float]:
    """SDPA's own worst-element errors {out, q, k, v} against float64 `ref` = (out, dq, dk, dv)
    on the same inputs (K/V expanded for GQA, so every SDPA backend takes them)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                         is_causal=causal, scale=scale)
    out.backward(dout.to(out.dtype))
    return {"out": max_err(out, ref[0])} | {n: max_err(a.grad, r) for n, a, r in zip("qkv", (q, k, v), ref[1:])}


def max_err_bounds(q, k, v, dout, causal: bool, scale: float | None, ref) -> dict[str, float]:
    """What a kernel's max_err may be on these inputs, per {out, q, k, v} (see the module docstring)."""
    sdpa = sdpa_max_errs(q, k, v, dout, causal, scale, ref)
    return {n: max(SDPA_FACTOR * e, FLOOR[q.dtype]) for n, e in sdpa.items()}

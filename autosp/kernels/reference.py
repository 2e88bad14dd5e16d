"""Float64 attention, forward and backward, and the error measures the kernels are held to.

One definition for the tests, the autotuner and the GPU check: a kernel (or a tuning candidate)
is compared with float64, never with another kernel.

Error measures, both relative to the reference's largest entry:
  rel_norm   ||a - ref|| / ||ref||: the overall error;
  max_err    max |a - ref| / max |ref|: the worst element, so one bad row (a wrong tile, a
             missed rescale) shows even when the norm hides it among s rows.
"""
from __future__ import annotations

import math

import torch


def attention_f64(q, k, v, causal: bool, scale: float | None = None, do=None):
    """(o, lse) or, with `do`, (o, lse, dq, dk, dv), all float64; q [b, hq, s, d], k/v
    [b, hkv, s, d] (GQA: query head h reads KV head h // (hq // hkv)). The torch backend's
    math path run in float64 (chunked over query rows: memory bounded at any s)."""
    from autosp.kernels.flash_torch import math_backward, math_forward
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k, v = (t.detach().double() for t in (q, k, v))
    o, lse = math_forward(q, k, v, causal, scale)
    if do is None:
        return o, lse
    return (o, lse, *math_backward(do.detach().double(), q, k, v, o, lse, None, causal, scale))


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

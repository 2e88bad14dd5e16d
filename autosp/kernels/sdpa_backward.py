"""SDPA's backward by autosp's own kernel: `autosp::sdpa_backward`, what a planned step runs in place of the
backend's attention backward where the plan says so (autosp/passes/attention_backward.py).

    dq, dk, dv = torch.ops.autosp.sdpa_backward(grad_out, q, k, v, out, lse, causal, scale)   # backend="auto"

Takes what an SDPA backward takes (the forward's output and its natural-log LSE [b, hq, s]) and returns the
gradients in the layouts of q, k and v (a backend's backward does; the programs it enters view them so).
On CUDA/ROCm it is autosp's Triton backward (autosp/kernels/flash.py): dK/dV summed per KV head inside the
kernel (no copy at every query head under GQA) and dQ accumulated in registers (no fp32 dQ in memory); its
scratch is two fp32 rows per query row (`scratch_bytes`). Elsewhere it is ATen's own backward
(flash_torch.torch_backward), so a CPU step runs the same numbers either way.
"""
from __future__ import annotations

from typing import Optional

import torch

from autosp.kernels.flash import _padded_head_dim, _resolve_scale, _triton_backward, _kernel_unsupported
from autosp.kernels._triton import resolve_backend
from autosp.kernels.flash_torch import torch_backward


def scratch_bytes(q, k, device_kind: str) -> int:
    """Bytes the kernel holds while it runs beyond its outputs, for q [b, hq, s, d], k [b, hkv, s, d] (anything with
    .shape and .dtype): on a GPU the rows of delta and the base-2 LSE (fp32, [b, hq, s] each), and the inputs
    padded to the kernel's head dim when d is not one (q, k, v, out, grad_out, and the padded grads)."""
    b, hq, s, d = q.shape
    if device_kind == "cpu":
        return 0                      # priced as ATen's CPU backward it runs (liveness)
    rows = 8 * b * hq * s
    dp = _padded_head_dim(d)
    if dp == d:
        return rows
    item = q.dtype.itemsize
    padded = (3 * b * hq * s + 2 * k.shape[0] * k.shape[1] * k.shape[2]) * dp * item   # q, out, grad_out, k, v
    grads = (b * hq * s + 2 * k.shape[0] * k.shape[1] * k.shape[2]) * dp * item        # dq, dk, dv padded
    return rows + padded + grads


def _like(t: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """src in t's layout (a copy only where they differ)."""
    if src.stride() == t.stride():
        return src
    out = torch.empty_like(t)
    out.copy_(src)
    return out


@torch.library.custom_op("autosp::sdpa_backward", mutates_args=())
def sdpa_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: Optional[float], backend: str = "auto"
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    sc = _resolve_scale(scale, q.shape[-1])
    grad_out = grad_out.to(q.dtype)
    lse = lse.reshape(q.shape[:3])
    if resolve_backend("sdpa_backward", backend, q, _kernel_unsupported(q)) == "triton":
        dq, dk, dv = _triton_backward(grad_out, q, k, v, out, lse, None, causal, sc)
    else:
        dq, dk, dv = torch_backward(grad_out, q, k, v, out, lse, None, causal, sc)
    return _like(q, dq), _like(k, dk), _like(v, dv)


@sdpa_backward.register_fake
def _sdpa_backward_fake(grad_out, q, k, v, out, lse, causal, scale, backend="auto"):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

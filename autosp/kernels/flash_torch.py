"""The torch backend of `autosp::flash_attention`: exact, no Triton.

On CPU it calls the fused kernel behind SDPA itself
(`aten._scaled_dot_product_flash_attention_for_cpu`), which also returns the LSE,
so outputs equal `F.scaled_dot_product_attention` bit for bit; its backward is
SDPA's backward. GQA is expanded to MHA for that kernel and dK/dV are summed
back over each group. Elsewhere (a GPU tensor with a head dim Triton does not
take, an LSE gradient, a torch without that op) the math path runs: fp32 (or
fp64) scores, chunked over query rows so the s x s block stays bounded.
"""
from __future__ import annotations

import torch

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_CHUNK_ELEMS = 1 << 26  # scores per chunk of the math path: 256 MiB in fp32


def _use_cpu_flash(q: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and _CPU_FLASH is not None and _CPU_FLASH_BWD is not None
            and q.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16))


def _expand_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    # [b, hkv, s, d] -> [b, hkv * group, s, d]; query head h reads KV head h // group.
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _fold_kv_grad(g: torch.Tensor, group: int) -> torch.Tensor:
    # [b, hkv * group, s, d] -> [b, hkv, s, d]: a KV head's gradient sums over its query heads.
    if group == 1:
        return g
    b, h, s, d = g.shape
    return g.reshape(b, h // group, group, s, d).sum(2)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, except fp64 inputs keep an fp64 LSE (gradcheck runs in fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(q: torch.Tensor):
    b, hq, s, _ = q.shape
    step = max(1, _CHUNK_ELEMS // max(1, b * hq * s))
    return [(i, min(s, i + step)) for i in range(0, s, step)]


def _scores(qc, k, i0, causal, scale):
    # qc [b, hkv, g, c, d] rows i0.. of the queries; k [b, hkv, 1, s, d] -> [b, hkv, g, c, s]
    sc = torch.matmul(qc, k.transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(i0, i0 + qc.shape[-2], device=qc.device)[:, None]
        cols = torch.arange(k.shape[-2], device=qc.device)[None, :]
        sc = sc.masked_fill(cols > rows, float("-inf"))
    return sc


def _grouped(q, k, v, ct):
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    return (q.to(ct).reshape(b, hkv, hq // hkv, s, d), k.to(ct)[:, :, None], v.to(ct)[:, :, None])


def math_forward(q, k, v, causal: bool, scale: float):
    ct = _compute_dtype(q.dtype)
    qg, kg, vg = _grouped(q, k, v, ct)
    out = torch.empty(qg.shape, dtype=ct, device=q.device)
    lse = torch.empty(qg.shape[:-1], dtype=ct, device=q.device)
    for i0, i1 in _chunks(q):
        sc = _scores(qg[..., i0:i1, :], kg, i0, causal, scale)
        lse[..., i0:i1] = torch.logsumexp(sc, dim=-1)
        out[..., i0:i1, :] = torch.matmul(torch.exp(sc - lse[..., i0:i1, None]), vg)
    return out.reshape(q.shape).to(q.dtype), lse.reshape(q.shape[:-1]).to(lse_dtype(q.dtype))


def math_backward(do, q, k, v, o, lse, dlse, causal: bool, scale: float):
    ct = _compute_dtype(q.dtype)
    qg, kg, vg = _grouped(q, k, v, ct)
    dog = do.to(ct).reshape(qg.shape)
    lseg = lse.to(ct).reshape(qg.shape[:-1])
    delta = (o.to(ct) * do.to(ct)).sum(-1).reshape(qg.shape[:-1])
    if dlse is not None:
        delta = delta - dlse.to(ct).reshape(qg.shape[:-1])
    dq = torch.empty(qg.shape, dtype=ct, device=q.device)
    dk = torch.zeros(kg.shape[:2] + kg.shape[3:], dtype=ct, device=q.device)
    dv = torch.zeros_like(dk)
    for i0, i1 in _chunks(q):
        p = torch.exp(_scores(qg[..., i0:i1, :], kg, i0, causal, scale) - lseg[..., i0:i1, None])
        doc = dog[..., i0:i1, :]
        dv += torch.einsum("bhgqk,bhgqd->bhkd", p, doc)
        ds = p * (torch.matmul(doc, vg.transpose(-1, -2)) - delta[..., i0:i1, None])
        dq[..., i0:i1, :] = torch.matmul(ds, kg) * scale
        dk += torch.einsum("bhgqk,bhgqd->bhkd", ds, qg[..., i0:i1, :]) * scale
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def torch_forward(q, k, v, causal: bool, scale: float):
    """(out [b, hq, s, d] contiguous, lse [b, hq, s] in `lse_dtype`)."""
    if _use_cpu_flash(q):
        group = q.shape[1] // k.shape[1]
        out, lse = _CPU_FLASH(q, _expand_kv(k, group), _expand_kv(v, group), 0.0, causal, scale=scale)
        return out.contiguous(), lse.to(lse_dtype(q.dtype)).contiguous()
    return math_forward(q, k, v, causal, scale)


def torch_backward(do, q, k, v, o, lse, dlse, causal: bool, scale: float):
    """(dq, dk, dv), contiguous, in the inputs' dtypes."""
    if _use_cpu_flash(q) and dlse is None:
        group = q.shape[1] // k.shape[1]
        dq, dk, dv = _CPU_FLASH_BWD(do, q, _expand_kv(k, group), _expand_kv(v, group), o, lse, 0.0, causal,
                                    scale=scale)
        return dq.contiguous(), _fold_kv_grad(dk, group).contiguous(), _fold_kv_grad(dv, group).contiguous()
    dq, dk, dv = math_backward(do, q, k, v, o, lse, dlse, causal, scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()

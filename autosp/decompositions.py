"""Decompositions autosp applies while tracing: ops whose fake kernel refuses inputs eager accepts.

`aten._grouped_mm` (torch.nn.functional.grouped_mm, transformers' default MoE experts kernel) has a
meta kernel written for CUDA's bf16 kernel: under fake tensors it rejects fp32 and fp16, which the
CPU kernel runs. Tracing maps the form transformers calls, (M, K) x (G, K, N) with offsets, onto
`autosp::grouped_mm` (autosp/ops.py): a fake kernel for every dtype, the same torch kernel at run
time, so the traced program computes what eager computes. The (G, M, K) x (G, K, N) form is bmm.
"""
from __future__ import annotations

import torch

from autosp import ops as autosp_ops

aten = torch.ops.aten


def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """aten._grouped_mm while tracing. The forms with offsets along K (2-D x 2-D) or on mat_b's rows
    (3-D x 2-D), a bias or another output dtype go to the op unchanged (NotImplemented): they trace
    where torch's fake kernel does."""
    if bias is not None or (out_dtype is not None and out_dtype != mat_a.dtype):
        return NotImplemented
    if mat_a.dim() == 3 and mat_b.dim() == 3 and offs is None:
        return torch.bmm(mat_a, mat_b)
    if mat_a.dim() == 2 and mat_b.dim() == 3 and offs is not None:
        return autosp_ops.grouped_mm(mat_a, mat_b, offs)
    return NotImplemented


def histc(x, bins=100, min=0, max=0):
    """aten.histc while tracing. transformers counts tokens per expert with `histc(ids.int())` off the CPU (CUDA's
    kernel takes integers, the CPU's and the meta kernel do not): a meta trace of a model meant for a GPU
    reaches it. The counts of integer ids are the float histogram's, in the ids' dtype."""
    if x.dtype.is_floating_point:
        return NotImplemented
    return aten.histc.default(x.to(torch.float32), bins, min, max).to(x.dtype)


def trace_decompositions() -> dict:
    """The table make_fx applies while autosp traces; an op this torch lacks is left out."""
    table = {}
    op = getattr(aten, "_grouped_mm", None)   # not in every torch
    if op is not None:
        table[op.default] = grouped_mm
    table[aten.histc.default] = histc
    return table

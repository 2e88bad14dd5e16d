"""Which kernel runs each attention backward of a step: a rewrite of the joint program, chosen by the planner.

At long context the attention backward's own scratch is the largest single term of a step's peak on a GPU: SDPA's
cuDNN backend holds dQ in fp32 and, under GQA, dK/dV at every query head before their sum (516 MiB for one layer of
Llama 3.2 1B at 32K tokens; liveness.cuda_cudnn_backward). autosp's kernel (`autosp::sdpa_backward`) holds two fp32
rows per query row instead. The planner (remat/__init__.py) prices the step both ways and keeps the backend where
it fits and is faster; this module is the rewrite:

    joint2 = with_autosp_backward(joint)              # every eligible attention backward -> autosp::sdpa_backward
    eligible(e)                                        # an SDPA backward it can take (no mask, no dropout)

The new equation reads what the old one read (grad_out, q, k, v, out, lse) and writes the same variables in the
same layouts, so nothing downstream changes and the plan's remat decisions carry over.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from autosp.ir.core import Eqn
from autosp.ir.ops import op_for

aten = torch.ops.aten

# SDPA backward overloads with (grad_out, query, key, value, out, logsumexp) first and dQ, dK, dV out: ATen's CPU
# kernel (what a meta or CPU trace differentiates with), FLASH's and cuDNN's (a GPU trace)
_BACKWARDS = tuple(getattr(aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward") if hasattr(aten, name))


def eligible(e: Eqn) -> bool:
    """An attention backward autosp's kernel computes exactly: causal or not, GQA, no mask tensor, no dropout, a dtype
    and head dim its Triton kernel takes (elsewhere it would run the math path, whose memory no plan counts)."""
    if e.op.target not in _BACKWARDS or len(e.outputs) != 3:
        return False
    b = e.bind_schema()
    mask = b.get("attn_mask", b.get("attn_bias"))
    q, k = b["query"], b["key"]
    from autosp.kernels.flash import _kernel_unsupported
    return (mask is None and not b.get("dropout_p") and q.ndim == 4 and k.ndim == 4 and q.shape[1] % k.shape[1] == 0
            and b["logsumexp"].numel() == q.numel() // q.shape[-1] and _kernel_unsupported(q) is None)


def autosp_backward(e: Eqn) -> Eqn:
    """The equation that computes eligible `e` with autosp::sdpa_backward, its outputs the same variables."""
    b = e.bind_schema()
    args = (b["grad_out"], b["query"], b["key"], b["value"], b["out"], b["logsumexp"], bool(b["is_causal"]),
            b.get("scale"))
    return Eqn.make(op_for(torch.ops.autosp.sdpa_backward.default), args, {}, e.outputs, multi=True,
                    source=e.source)


def with_autosp_backward(joint):
    """The joint program with every eligible attention backward computed by autosp's kernel (the same joint if
    none is)."""
    import autosp.kernels.sdpa_backward  # noqa: F401 - registers autosp::sdpa_backward
    eqns = joint.graph.eqns
    new = tuple(autosp_backward(e) if i >= joint.boundary and eligible(e) else e for i, e in enumerate(eqns))
    if all(a is b for a, b in zip(new, eqns)):
        return joint
    return replace(joint, graph=replace(joint.graph, eqns=new))


def count(joint) -> int:
    """Attention backwards of the joint that autosp's kernel could take."""
    return sum(eligible(e) for e in joint.backward_eqns)


def candidates(graph) -> int:
    """SDPA calls of a forward program whose backward autosp's kernel could take (no mask, no dropout, a dtype and
    head dim it takes): read off the forward, so that asking needs no joint."""
    from autosp.kernels.flash import _kernel_unsupported
    n = 0
    for e in graph.eqns:
        if e.op.target is aten.scaled_dot_product_attention.default:
            b = e.bind_schema()
            n += b["attn_mask"] is None and not b["dropout_p"] and _kernel_unsupported(b["query"]) is None
    return n

"""Which kernel runs an attention of a program: a lowering choice, made per equation.

The sharding pass names one attention op (SDPA) and knows no kernels. Lowering (autosp/ir/lower.py)
asks `attention_kernel` and calls autosp's Triton flash kernel where the GPU check measured it
faster than SDPA at this device, dtype, head dim, mask and length (kernels.config.measured_speedup),
SDPA everywhere else; `autosp explain` asks the same function, so it says what runs.
"""
from __future__ import annotations

import torch

from autosp.ir.core import Eqn, Var

aten = torch.ops.aten


def attention_kernel(e: Eqn) -> str:
    """"flash" (autosp::flash_attention) or "sdpa" for an attention equation. Flash takes no mask
    tensor and no dropout, and runs only where it was measured faster."""
    if e.op.target is not aten.scaled_dot_product_attention.default:
        return "sdpa"
    b = e.bind_schema()
    if b["attn_mask"] is not None or b["dropout_p"]:
        return "sdpa"
    return "flash" if flash_is_faster(e.inputs[0], bool(b["is_causal"])) else "sdpa"


def flash_is_faster(q: Var, causal: bool) -> bool:
    """Whether autosp::flash_attention beats SDPA for these inputs, by the GPU check's measurement in
    the kernel config cache (kernels.config.measured_speedup); SDPA when unmeasured."""
    device = torch.device(q.device)
    if device.type != "cuda" or q.ndim != 4 or not torch.cuda.is_available():
        return False
    from autosp.kernels import config
    from autosp.kernels._triton import device_name
    speedup = config.measured_speedup(device_name(device), q.dtype, q.shape[-1], causal, q.shape[-2])
    return speedup is not None and speedup > 1.0


def flash_call(e: Eqn, values) -> tuple:
    """(target, args) of the autosp::flash_attention call that computes SDPA equation `e` on `values`
    (its output 0 is SDPA's output; GQA needs no flag: fewer K/V heads are read as groups)."""
    b = e.bind_schema(values)
    return (torch.ops.autosp.flash_attention.default,
            (b["query"], b["key"], b["value"], bool(b["is_causal"]), b["scale"], "auto"))

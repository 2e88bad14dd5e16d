"""The cost model: seconds per equation on a device, from FLOPs, bytes moved and link bandwidths.

FLOPs come from torch.utils.flop_counter's formulas (matmuls, convolutions, attention
backends); autosp registers honest ones where torch has none (the CPU flash attention and
its backward, with the causal half). An op without a formula is memory-bound: its bytes
read and written over the device's memory bandwidth. Collectives cost their bytes over the
link bandwidth plus a latency. Nothing here thresholds on sequence length: attention's s^2
and the linears' s come out of the formulas, and so does sequence-awareness.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autosp.ir.core import Eqn, Var
from autosp.ir.ops import Tag

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    flops: float              # dense matmul FLOP/s at the working dtype
    mem_bw: float             # bytes/s
    link_bw: float            # bytes/s per rank for collectives
    host_bw: float | None     # bytes/s to pinned host memory; None: no offload
    launch: float = 5e-6      # seconds of overhead per op
    latency: float = 2e-5     # seconds per collective


# Rough figures: only ratios matter to the plan, and they are what a planner without a
# profiler can know. `host_bandwidth=` / `device=` override them.
DEVICES = {
    "cpu": Device("cpu", flops=1e11, mem_bw=1e10, link_bw=2e9, host_bw=None, launch=2e-6, latency=5e-5),
    "cuda": Device("cuda", flops=7e14, mem_bw=4e12, link_bw=3e11, host_bw=5e10, launch=5e-6, latency=2e-5),
}


def device_for(kind: str, host_bandwidth: float | None = None) -> Device:
    base = DEVICES.get(kind, DEVICES["cuda"] if kind in ("cuda", "hip") else DEVICES["cpu"])
    if host_bandwidth is not None:
        from dataclasses import replace
        base = replace(base, host_bw=float(host_bandwidth))
    return base


@dataclass(frozen=True, slots=True)
class Cost:
    flops: int
    seconds: float


def _meta(v):
    if isinstance(v, Var):
        if v.dtype is None:
            return None
        return torch.empty(v.shape, dtype=v.dtype, device="meta")
    return v


def flops(e: Eqn) -> int:
    """FLOPs of one equation, from torch's flop counter registry (0 if it has no formula)."""
    from torch.utils.flop_counter import flop_registry
    _register_formulas()
    target = e.op.target
    packet = getattr(target, "overloadpacket", None)
    f = flop_registry.get(packet)
    if f is None:
        return 0
    args, kwargs = e.bind([_meta(x) for x in e.inputs])
    outs = [_meta(o) for o in e.outputs]
    out = tuple(outs) if e.multi else (outs[0] if outs else None)
    try:
        return int(f(*args, out_val=out, **kwargs))
    except Exception:  # noqa: BLE001 - a formula that cannot read these arguments counts as memory-bound
        return 0


def _bytes(vs) -> int:
    return sum(v.numel() * v.dtype.itemsize for v in vs if isinstance(v, Var) and v.dtype is not None)


# ring attention's ops (autosp/ring.py): the masked variant's arguments begin as the plain one's
RING_FORWARD = ("ring_attention", "ring_masked_attention")
RING_OPS = RING_FORWARD + ("ring_attention_backward", "ring_masked_attention_backward")


def ring_size(e: Eqn) -> int:
    """R of a ring attention equation: its group's size, or the padded length over the local one."""
    from autosp.collectives import group_size
    args = e.var_args()[0]
    try:
        return group_size(args[7] if e.op.name in RING_FORWARD else args[10])
    except Exception:  # noqa: BLE001 - planned away from its process group
        valid, s = (args[5], e.inputs[0].shape[-2]) if e.op.name in RING_FORWARD else (args[8], e.inputs[1].shape[-2])
        return -(-valid // s)


def _ring_terms(e: Eqn, device: Device) -> tuple[float, float, float, float]:
    # this rank's queries against every key of the ring (causal: half of the pairs), and K/V blocks
    # over the link (the backward: K/V and their fp32 gradients)
    fwd = e.op.name in RING_FORWARD
    q, k, v = (e.inputs[0], e.inputs[1], e.inputs[2]) if fwd else (e.inputs[1], e.inputs[2], e.inputs[3])
    causal = e.var_args()[0][3 if fwd else 6]
    r = ring_size(e)
    b = q.numel() // (q.shape[-1] * q.shape[-2])
    full = 2 * b * q.shape[-2] * r * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    f = (full // 2 if causal else full) * (1 if fwd else 3)     # the backward: about 3x the forward
    sent = (r - 1) * (k.nbytes() + v.nbytes()) * (1 if fwd else 3)
    return device.launch * r, float(int(f)), 0.0, float(sent)


_POSTED = {"all_to_all_start": -1, "all_gather_param_start": -1, "reduce_scatter_param_start": 0}


def eqn_terms(e: Eqn, device: Device) -> tuple[float, float, float, float]:
    """(fixed seconds, FLOPs, bytes through memory, bytes over the links) of an equation: its seconds are
    fixed + max(FLOPs / flops, memory bytes / mem_bw) + link bytes / link_bw (`_seconds`). Apart, so that
    `autosp plan` can carry each term to another length by how it grows (FLOPs as a L^2 + b L, bytes
    affinely)."""
    if e.op.name in RING_OPS:
        return _ring_terms(e, device)
    if e.op.name in _POSTED:
        # a start (autosp.inflight) moves what the blocking collective moved: the all-to-all's receive buffer, the
        # gathered parameter, the padded gradient; its wait and its results cost what copies cost
        return device.latency, 0.0, 0.0, float(_bytes(e.outputs[_POSTED[e.op.name]:][:1]))
    if e.op.name == "wait_collective":
        return 0.0, 0.0, 0.0, 0.0
    if e.op.has(Tag.COLLECTIVE) or e.op.name in ("all_to_all", "all_reduce_sum", "all_gather_seq"):
        # the whole tensor crosses the links: a gather's output, a reduce-scatter's input
        moved = _bytes(e.inputs) if e.op.name == "reduce_scatter_param" else _bytes(e.outputs)
        return device.latency, 0.0, 0.0, float(moved)
    from autosp.ir.aliases import aliases
    if all(a is not None for a in aliases(e)) and e.outputs:
        return 0.0, 0.0, 0.0, 0.0             # a view: free
    return device.launch, float(flops(e)), float(_bytes(e.inputs) + _bytes(e.outputs)), 0.0


def _seconds(fixed, f, mem, link, device: Device, maximum=max):
    return fixed + maximum(f / device.flops, mem / device.mem_bw) + link / device.link_bw


def terms_seconds(fixed, f, mem, link, device: Device):
    """Seconds of equations from arrays of their terms (eqn_terms, one entry per equation)."""
    import numpy as np
    return _seconds(fixed, f, mem, link, device, np.maximum)


def eqn_cost(e: Eqn, device: Device) -> Cost:
    fixed, f, mem, link = eqn_terms(e, device)
    return Cost(int(f), _seconds(fixed, f, mem, link, device))


_REGISTERED = []


def _register_formulas() -> None:
    """Attention backends torch's counter does not know: the CPU flash kernel and its backward."""
    if _REGISTERED:
        return
    _REGISTERED.append(True)
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    def attn(q, k, causal):
        b = 1
        for d in q[:-2]:
            b *= d
        sq, d = q[-2], q[-1]
        skv, dv = k[-2], k[-1]
        full = 2 * b * sq * skv * (d + dv)
        if causal and sq == skv:
            full = full * (sq + 1) // (2 * sq)
        return full

    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if fwd is not None and fwd not in flop_registry:
        @register_flop_formula(fwd)
        def _cpu_fwd(q, k, v, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs) -> int:
            return attn(q, k, is_causal)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if bwd is not None and bwd not in flop_registry:
        @register_flop_formula(bwd)
        def _cpu_bwd(gout, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kw) -> int:
            return attn(q, k, is_causal) * 5 // 2      # 5 matmuls (QK^T recomputed) against the forward's 2

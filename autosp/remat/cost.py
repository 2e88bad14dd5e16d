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
    name: str                 # what plans name it by: 'cpu', 'cuda' (the default GPU) or a GPU of GPUS ('h100')
    flops: float              # dense matmul FLOP/s at the working dtype
    mem_bw: float             # bytes/s
    link_bw: float            # bytes/s per rank for collectives
    host_bw: float | None     # bytes/s to pinned host memory; None: no offload
    launch: float = 5e-6      # seconds of overhead per op
    latency: float = 2e-5     # seconds per collective
    attention: str = "cpu"    # the SDPA backend whose kernels (and scratch) run attention: cpu, cudnn, flash, efficient
    memory: int | None = None # bytes a GPU of this name has for the step (the --memory it plans for by default)
    title: str = ""           # what the banner says it is

    @property
    def kind(self) -> str:
        """The torch device type its kernels run on: 'cpu' or 'cuda' (ROCm's GPUs are 'cuda' to torch too)."""
        return "cpu" if self.attention == "cpu" else "cuda"


# Rough figures: only ratios matter to the plan, and they are what a planner without a
# profiler can know. `host_bandwidth=` / `device=` override them.
DEVICES = {
    "cpu": Device("cpu", flops=1e11, mem_bw=1e10, link_bw=2e9, host_bw=None, launch=2e-6, latency=5e-5),
    "cuda": Device("cuda", flops=7e14, mem_bw=4e12, link_bw=3e11, host_bw=5e10, launch=5e-6, latency=2e-5,
                   attention="cudnn", title="an H100/H200-class GPU (SDPA's cuDNN backend, as measured on an H200)"),
}

# GPUs a plan can be made for (`--gpu`): the vendors' dense bf16 FLOP/s, memory bandwidth, per-GPU link bandwidth
# (NVLink / Infinity Fabric, one direction) and host link (PCIe), the memory torch can allocate on one, and the
# SDPA backend torch runs for causal bf16 attention at head dims up to 128 there (the H200's memory is what the one
# lent on 2026-12-04 offered torch, "about 139 GiB"; the others' their data sheets'). Measured: the H200's (cuDNN,
# torch 2.11; bench/RESULTS.md, "The whole step on an H200"). The others' backends are torch's priority order for
# their architecture (sdp_utils: cuDNN first on sm90 and sm100, FLASH on sm80, ROCm's AOTriton FLASH on gfx942),
# priced with that backend's scratch as measured on the H200: not measured on those GPUs.
GiB = 2**30
GPUS = {
    "h100": Device("h100", flops=989e12, mem_bw=3.35e12, link_bw=450e9, host_bw=55e9, attention="cudnn",
                   memory=80 * GiB, title="NVIDIA H100 SXM 80 GB"),
    "h200": Device("h200", flops=989e12, mem_bw=4.8e12, link_bw=450e9, host_bw=55e9, attention="cudnn",
                   memory=139 * GiB, title="NVIDIA H200 141 GB (139 GiB to torch)"),
    "a100": Device("a100", flops=312e12, mem_bw=2.04e12, link_bw=300e9, host_bw=25e9, attention="flash",
                   memory=80 * GiB, title="NVIDIA A100 SXM 80 GB"),
    "b200": Device("b200", flops=2.25e15, mem_bw=8e12, link_bw=900e9, host_bw=55e9, attention="cudnn",
                   memory=180 * GiB, title="NVIDIA B200 180 GB"),
    "mi300x": Device("mi300x", flops=1307e12, mem_bw=5.3e12, link_bw=448e9, host_bw=55e9, attention="flash",
                     memory=192 * GiB, title="AMD MI300X 192 GB"),
}
DEVICES.update(GPUS)


def device_for(kind: str, host_bandwidth: float | None = None) -> Device:
    """The cost and memory model of a device by name: 'cpu', 'cuda' (the default GPU) or a GPU of GPUS;
    'hip' is the default GPU too."""
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
        n = int(f(*args, out_val=out, **kwargs))
    except Exception:  # noqa: BLE001 - a formula that cannot read these arguments counts as memory-bound
        return 0
    if target in _gpu_attention() and e.bind_schema().get("is_causal"):
        # torch counts every (query, key) pair of a GPU backend's attention; causal kernels skip the upper half, as
        # autosp's formula for the CPU's kernel says: a step traced on a GPU and one traced on the host for it then
        # price attention alike (the same plan)
        q = e.inputs[1] if "backward" in str(target) else e.inputs[0]
        k = e.inputs[2] if "backward" in str(target) else e.inputs[1]
        sq = q.shape[-2]
        if sq == k.shape[-2]:
            n = n * (sq + 1) // (2 * sq)
    return n


_GPU_ATTENTION: list = []


def _gpu_attention() -> frozenset:
    """SDPA's GPU overloads, forward and backward (those this torch has)."""
    if not _GPU_ATTENTION:
        names = [f"_scaled_dot_product_{k}_attention{b}" for k in ("flash", "cudnn", "efficient")
                 for b in ("", "_backward")]
        _GPU_ATTENTION.append(frozenset(getattr(aten, n).default for n in names if hasattr(aten, n)))
    return _GPU_ATTENTION[0]


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
        # the whole tensor crosses the links: a gather's output, a reduce-scatter's input; a halo's positions
        # (halo_grad sends its input back and adds it into a whole chunk)
        moved = _bytes(e.inputs) if e.op.name in ("reduce_scatter_param", "halo_grad") else _bytes(e.outputs)
        return device.latency, 0.0, 0.0, float(moved)
    from autosp.ir.aliases import aliases
    if all(a is not None for a in aliases(e)) and e.outputs:
        return 0.0, 0.0, 0.0, 0.0             # a view: free
    f = float(flops(e))
    if e.op.name == "sdpa_backward" and device.attention in AUTOSP_BACKWARD_PACE:
        f *= AUTOSP_BACKWARD_PACE[device.attention]
    return device.launch, f, float(_bytes(e.inputs) + _bytes(e.outputs)), 0.0


# autosp's Triton attention backward (autosp::sdpa_backward) against the backend a GPU runs otherwise, time for
# time: on an H200, bf16, d 128, s 16K, GQA 4:1, 14.9 ms against cuDNN's 10.5 and FLASH's 17.9 (bench/RESULTS.md,
# "Kernels"); its FLOPs are counted this much more (or less) so the planner weighs memory against time
AUTOSP_BACKWARD_PACE = {"cudnn": 14.9 / 10.5, "flash": 14.9 / 17.9}


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
    import autosp.kernels.sdpa_backward  # noqa: F401 - registers autosp::sdpa_backward
    ours = torch.ops.autosp.sdpa_backward
    if ours not in flop_registry:
        @register_flop_formula(ours)
        def _autosp_bwd(gout, q, k, v, out, lse, is_causal=False, *args, out_shape=None, **kw) -> int:
            return attn(q, k, is_causal) * 5 // 2

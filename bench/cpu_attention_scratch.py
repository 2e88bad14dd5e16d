"""ATen's CPU flash attention backward: its transient allocations, measured, against the memory model's.

A kernel's workspace is what it allocates while it runs beyond its outputs: the peak of the running sum of the
profiler's allocation events (`profile_memory=True`, `[memory]` events by `start_ns`) during the call, minus
what is allocated once it returns (dQ, dK, dV). The memory model counts it in
autosp/remat/liveness.py, `_cpu_flash_backward`; this script calls
`aten._scaled_dot_product_flash_attention_for_cpu_backward` alone (inputs made before the profiler starts) over
head dims, lengths, thread counts, dtypes and GQA, and prints one markdown table: measured, modelled, and
model - measured (positive: the model over-counts, which only wastes memory; negative: an under-prediction). The
model's half-precision GEMM scratch is an envelope fitted to this script's measurements (see _cpu_flash_backward).

fp32 is exact. In bf16 the kernel's own buffers are exact too; what differs is oneDNN's GEMM scratch, allocated
and freed around each block's GEMM (sized by the thread count and the block's shapes, not by batch, heads or GQA).

    python bench/cpu_attention_scratch.py [--dims 32,64,96,128,256] [--lengths 127,256,768,2048] [--threads 1,2]
                                          [--batch 1] [--heads 4] [--kv-heads 2] [--no-causal]
"""
from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from autosp.memory import _quiet_stderr  # noqa: E402
from autosp.remat.liveness import _cpu_flash_backward  # noqa: E402

aten = torch.ops.aten


def _running_peak(prof) -> tuple[int, int]:
    """(peak, final) of the running sum of a session's allocation events, in time order."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak, cur


def measure(b, h, hkv, s, d, dtype, threads, causal=True) -> tuple[int, int]:
    """(measured workspace, the model's) of one backward call."""
    from torch.profiler import ProfilerActivity, profile
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, s, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=g).to(dtype)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)   # GQA: K/V heads as given
    gout = torch.randn(out.shape, generator=g).to(dtype)
    args = (gout, q, k, v, out, lse, 0.0, causal)
    aten._scaled_dot_product_flash_attention_for_cpu_backward(*args)        # warm: oneDNN's primitives made once
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.__enter__()
    try:
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(*args)
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    peak, after = _running_peak(prof)
    assert after == sum(x.nbytes for x in grads), (after, [x.shape for x in grads])
    e = SimpleNamespace(inputs=list(args[:6]))      # what the model reads of an Eqn: inputs' shape, dtype, numel
    return peak - after, _cpu_flash_backward(e)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda t: [int(x) for x in t.split(",")]  # noqa: E731
    ap.add_argument("--dims", type=ints, default=[32, 64, 96, 128, 256])
    ap.add_argument("--lengths", type=ints, default=[127, 256, 768, 2048])
    ap.add_argument("--threads", type=ints, default=[1, 2])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--no-causal", action="store_true")
    a = ap.parse_args(argv)
    print(f"torch {torch.__version__}, causal {not a.no_causal}, batch {a.batch}, heads {a.heads} "
          f"(GQA: {a.kv_heads} K/V heads)\n")
    print("| dtype | threads | heads q/kv | L | D | measured B | model B | model - measured |")
    print("|---|---|---|---|---|---|---|---|")
    worst = {}
    for dtype in (torch.bfloat16, torch.float32):
        for threads in a.threads:
            for hkv in sorted({a.heads, a.kv_heads}, reverse=True):
                for s in a.lengths:
                    for d in a.dims:
                        got, model = measure(a.batch, a.heads, hkv, s, d, dtype, threads, not a.no_causal)
                        off = model - got
                        print(f"| {str(dtype).removeprefix('torch.')} | {threads} | {a.heads}/{hkv} | {s} | {d} | "
                              f"{got:,} | {model:,} | {off:+,} ({off / max(got, 1):+.1%}) |", flush=True)
                        where = f"threads {threads}, heads {a.heads}/{hkv}, L {s}, D {d}"
                        worst.setdefault(str(dtype).removeprefix("torch."), []).append((off, off / max(got, 1), where))
    print()
    for key, rows in worst.items():
        lo, hi = min(rows), max(rows)
        print(f"{key}, model - measured: least {lo[0]:+,} B ({lo[1]:+.1%}, {lo[2]}); "
              f"most {hi[0]:+,} B ({hi[1]:+.1%}, {hi[2]})")


if __name__ == "__main__":
    main()

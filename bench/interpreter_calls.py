"""The flash kernels in Triton's interpreter, their calls of each other direct or Triton's, side by side.

    .venv/bin/python bench/interpreter_calls.py [--rounds 3] [--seq 300]

Triton's interpreter (3.9) patches every builtin of triton.language again whenever an interpreted kernel calls
another (`InterpretedFunction.__call__`); autosp's kernels call their rewritten bodies directly instead
(`autosp.kernels._triton._Interpreted`). One process, one attention forward and backward (4 query heads, 2 KV heads,
d 64, causal, fp32) timed with the direct calls and with Triton's, alternately; prints each time, the medians and
their ratio. This is where the suite's kernel tests spend their time (tests/test_kernels.py, tests/test_masked.py).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"          # before triton is imported (autosp.kernels._triton)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    import torch

    from autosp.kernels import _triton, flash
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seq", type=int, default=300)
    a = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, a.seq, 64, generator=g, requires_grad=True) for h in (4, 2, 2))

    def step() -> float:
        t = time.perf_counter()
        flash.flash_attention(q, k, v, causal=True, backend="triton").sum().backward()
        return time.perf_counter() - t

    step()                                     # jits the module, imports what a first call imports
    ns = vars(flash)
    shims = {n: f for n, f in ns.items() if isinstance(f, _triton._Interpreted)}
    if not shims:
        print("no interpreted kernels to compare (Triton without InterpretedFunction.rewrite?)")
        return 1
    times = {"direct": [], "triton": []}
    try:
        for _ in range(a.rounds):
            for mode in ("triton", "direct"):
                for name, f in shims.items():
                    ns[name] = f if mode == "direct" else f.fn
                times[mode].append(step())
    finally:
        ns.update(shims)
    for mode, ts in times.items():
        print(f"{mode:6s} " + ", ".join(f"{t:.2f}" for t in ts) + f" s (median {statistics.median(ts):.2f})")
    print(f"direct / triton: {statistics.median(times['direct']) / statistics.median(times['triton']):.3f} "
          f"({len(shims)} kernels and device functions, s = {a.seq})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

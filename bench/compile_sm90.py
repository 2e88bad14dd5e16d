"""Compile autosp's flash kernels for sm_90 (H100/H200) with their default configs, no GPU needed.

    .venv/bin/python bench/compile_sm90.py

Triton's ahead-of-time API (ASTSource + GPUTarget, Triton 3.9) runs the whole compiler, ptxas included,
so a kernel edit that breaks compilation, or a config that needs more than the 228 KB of shared memory
an SM has, shows on a CPU machine. Prints the shared memory of each kernel per dtype / head dim / mask.
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from autosp.kernels import config, flash_bwd, flash_fwd  # noqa: E402

target = GPUTarget("cuda", 90, 32)
def sig(names, ptrs, consts):
    s = {}
    for n in names:
        if n in consts: s[n] = "constexpr"
        elif n in ptrs: s[n] = ptrs[n]
        else: s[n] = "i32" if not n.startswith("qk_scale") and not n.startswith("sm_scale") else "fp32"
    return s
def comp(fn, ptrs, consts, warps, stages):
    names = fn.arg_names
    src = ASTSource(fn=fn, signature=sig(names, ptrs, consts), constexprs={(names.index(k),): v for k, v in consts.items()})
    t0 = time.time()
    k = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
    return k.metadata.shared, time.time() - t0
dev = torch.device("cuda")
for dt, tn in ((torch.bfloat16, "*bf16"), (torch.float16, "*fp16"), (torch.float32, "*fp32")):
    for d in (64, 128, 256):
        for causal in (True, False):
            cf = config.default_config("flash_fwd", dev, dt, d)
            p = {n: tn for n in ("Q", "K", "V", "O")} | {"LSE": "*fp32"}
            sh, t = comp(flash_fwd._attn_fwd, p, dict(HEAD_D=d, BLOCK_M=cf["BLOCK_M"], BLOCK_N=cf["BLOCK_N"], CAUSAL=causal, DOT_PREC=flash_fwd.dot_precision(dt)), cf["num_warps"], cf["num_stages"])
            cb = config.default_config("flash_bwd", dev, dt, d)
            pb = {n: tn for n in ("Q", "K", "V", "DO", "DK", "DV")} | {"LSE": "*fp32", "Delta": "*fp32"}
            common = dict(HEAD_D=d, CAUSAL=causal, DOT_PREC=flash_fwd.dot_precision(dt))
            sh1, t1 = comp(flash_bwd._bwd_dkdv, pb, dict(BLOCK_M=cb["BLOCK_M1"], BLOCK_N=cb["BLOCK_N1"], **common), cb["num_warps"], cb["num_stages"])
            pq = {n: tn for n in ("Q", "K", "V", "DO", "DQ")} | {"LSE": "*fp32", "Delta": "*fp32"}
            sh2, t2 = comp(flash_bwd._bwd_dq, pq, dict(BLOCK_M=cb["BLOCK_M2"], BLOCK_N=cb["BLOCK_N2"], **common), cb["num_warps"], cb["num_stages"])
            print(f"{str(dt)[6:]:9s} d{d:<3d} {'causal' if causal else 'full  '} fwd {sh//1024:4d} KB  dkdv {sh1//1024:4d} KB  dq {sh2//1024:4d} KB  ({t+t1+t2:.1f}s)", flush=True)

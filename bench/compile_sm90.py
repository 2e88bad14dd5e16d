"""Compile autosp's flash kernels for sm_90 (H100/H200) with their default configs, no GPU needed.

    .venv/bin/python bench/compile_sm90.py            # plain attention, then masked_attention's terms kernels
    .venv/bin/python bench/compile_sm90.py masked     # the terms kernels only (~1 min)

Triton's ahead-of-time API (ASTSource + GPUTarget, Triton 3.9) runs the whole compiler, ptxas included,
so a kernel edit that breaks compilation, or a config that needs more than the 228 KB of shared memory
an SM has, shows on a CPU machine. Prints the shared memory of each kernel per dtype / head dim / mask.
The terms kernels (N_TERMS > 0) are compiled for the masks the sharding pass emits most: causal with
document ids (two terms) and transformers' packed documents with a window (four).
"""
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # compiling needs the kernels jitted, not interpreted
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from autosp.kernels import config, flash  # noqa: E402
from autosp.kernels.maskterms import recognise  # noqa: E402

flash.load_kernels()
target = GPUTarget("cuda", 90, 32)
dev = torch.device("cuda")
FLOATS = ("qk_scale", "sm_scale")
# (label, N_TERMS, OPS) of the masks compiled; N_TERMS 0 is plain attention
MASKS = {"docs": recognise("((k <= q) & (x0[q] == x1[k]))"),
         "hf-window": recognise("(((x0 & (x1[k] > x2[q])) & (x1[k] <= x3[q])) & (x4[q] == x5[k]))")}


def signature(names, ptrs, consts):
    return {n: "constexpr" if n in consts else ptrs[n] if n in ptrs else "fp32" if n in FLOATS else "i32"
            for n in names}


def compile_kernel(fn, ptrs, consts, warps, stages):
    names = fn.arg_names
    src = ASTSource(fn=fn, signature=signature(names, ptrs, consts),
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    t0 = time.time()
    k = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
    return k.metadata.shared, time.time() - t0


def compile_set(dt, tn, d, causal, n_terms=0, ops=0):
    """Forward, dK/dV and dQ at their default configs; returns a printed line."""
    mask_ptr = "*i64" if n_terms else "*fp32"   # the plain launch passes lse as a placeholder
    mask = dict(N_TERMS=n_terms, OPS=ops)
    cf = config.default_config("flash_fwd", dev, dt, d)
    p = {n: tn for n in ("Q", "K", "V", "O")} | {"LSE": "*fp32", "TV": mask_ptr, "TB": mask_ptr}
    sh, t = compile_kernel(flash._attn_fwd, p, dict(HEAD_D=d, BLOCK_M=cf["BLOCK_M"], BLOCK_N=cf["BLOCK_N"],
                                                    CAUSAL=causal, DOT_PREC=flash.dot_precision(dt), **mask),
                           cf["num_warps"], cf["num_stages"])
    cb = config.default_config("flash_bwd", dev, dt, d)
    common = dict(HEAD_D=d, CAUSAL=causal, DOT_PREC=flash.dot_precision(dt), **mask)
    pb = {n: tn for n in ("Q", "K", "V", "DO", "DK", "DV")} | {"LSE": "*fp32", "Delta": "*fp32", "TV": mask_ptr,
                                                                "TB": mask_ptr}
    sh1, t1 = compile_kernel(flash._bwd_dkdv, pb, dict(BLOCK_M=cb["BLOCK_M1"], BLOCK_N=cb["BLOCK_N1"], **common),
                             cb["num_warps"], cb["num_stages"])
    pq = {n: tn for n in ("Q", "K", "V", "DO", "DQ")} | {"LSE": "*fp32", "Delta": "*fp32", "TV": mask_ptr,
                                                          "TB": mask_ptr}
    sh2, t2 = compile_kernel(flash._bwd_dq, pq, dict(BLOCK_M=cb["BLOCK_M2"], BLOCK_N=cb["BLOCK_N2"], **common),
                             cb["num_warps"], cb["num_stages"])
    return (f"fwd {sh // 1024:4d} KB  dkdv {sh1 // 1024:4d} KB  dq {sh2 // 1024:4d} KB  ({t + t1 + t2:.1f}s)")


DTYPES = ((torch.bfloat16, "*bf16"), (torch.float16, "*fp16"), (torch.float32, "*fp32"))


def main(what: str) -> None:
    if what in ("all", "plain"):
        for dt, tn in DTYPES:
            for d in (64, 128, 256):
                for causal in (True, False):
                    line = compile_set(dt, tn, d, causal)
                    print(f"{str(dt)[6:]:9s} d{d:<3d} {'causal' if causal else 'full  '} {line}", flush=True)
    if what in ("all", "masked"):
        for (dt, tn), d in ((DTYPES[0], 128), (DTYPES[1], 64), (DTYPES[2], 128)):
            for label, terms in MASKS.items():
                line = compile_set(dt, tn, d, terms.causal, len(terms.terms), terms.ops)
                print(f"{str(dt)[6:]:9s} d{d:<3d} {label:9s} ({len(terms.terms)} terms) {line}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all")

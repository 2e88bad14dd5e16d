"""Compile autosp's Triton kernels for AMD GPUs (MI300X gfx942, MI250X gfx90a) as a launch on ROCm would, no GPU
needed; report the VGPRs, spills, scratch and LDS of each kernel and config.

    .venv/bin/python bench/compile_rocm.py                   # the ROCm defaults (config.default_config(hip=True))
    .venv/bin/python bench/compile_rocm.py sweep             # candidate tilings of the flash kernels, both targets
    .venv/bin/python bench/compile_rocm.py --target gfx942   # one target
    .venv/bin/python bench/compile_rocm.py one --target gfx942   # one config of each kernel (the suite's check):
                                                             # exit status 1 if any spills

How: as bench/compile_sm90.py, with Triton's AMD backend. The real launchers run on meta tensors shaped like a
training call (b 1, 32 query / 8 KV heads, s 8192) with the kernels replaced by recorders; each launch is compiled
ahead of time (ASTSource + GPUTarget("hip", arch, 64)) under the JIT's specialisation of its arguments, through
LLVM's AMDGPU backend to a code object (hsaco). The ROCm dispatch has no tensor descriptors (TMA is NVIDIA's copy
engine): every config here moves tiles by pointers. Resources are the AMDGPU backend's own report in the
assembly: VGPRs (arch + accumulation), scratch (private memory: what a spill costs), LDS, waves per SIMD.
A spill is scratch traffic in the inner loop: the thing to avoid, as on NVIDIA.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends import backends  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from autosp.kernels import config, ulysses  # noqa: E402
from compile_sm90 import MASKS, compile_launch, launches  # noqa: E402

BACKEND = backends["amd"].compiler
TARGETS = {"gfx942": GPUTarget("hip", "gfx942", 64), "gfx90a": GPUTarget("hip", "gfx90a", 64)}
LABEL = {"_attn_fwd": "fwd", "_bwd_dkdv": "dkdv", "_bwd_dq": "dq", "_copy5": "copy"}


def compile_for(target, fn, args, kwargs):
    """One recorded launch compiled for `target` with the JIT's specialisation of its arguments."""
    return compile_launch(fn, args, kwargs, target=target, backend=BACKEND)


def resources(compiled) -> dict:
    """VGPRs (arch + accumulation), spilled VGPRs and SGPRs, scratch bytes per lane, LDS bytes, waves per SIMD."""
    asm = compiled.asm["amdgcn"]

    def first(key, default=-1):
        m = re.search(rf"; {key}: (\d+)", asm)
        return int(m.group(1)) if m else default
    spill = re.search(r"\.vgpr_spill_count:\s+(\d+)", asm)
    sspill = re.search(r"\.sgpr_spill_count:\s+(\d+)", asm)
    return dict(vgprs=first("TotalNumVgprs", first("NumVgprs")), spill=int(spill.group(1)) if spill else -1,
                sgpr_spill=int(sspill.group(1)) if sspill else -1, scratch=first("ScratchSize"),
                lds=compiled.metadata.shared, waves=first("Occupancy"))


def fmt(r: dict) -> str:
    return (f"{r['vgprs']:3d} VGPRs {r['spill']:3d} spilled ({r['sgpr_spill']} SGPR), scratch {r['scratch']:4d} B, "
            f"LDS {r['lds'] // 1024:3d} KB, {r['waves']} waves")


def copy_launch():
    """The Ulysses layout copy (pack and unpack are the same kernel on other strides): one recorded launch."""
    from autosp.kernels._triton import jit_module
    jit_module(vars(ulysses))                    # the jitted kernel, before the recorder stands in for it
    log = []
    saved = ulysses._copy5

    class Rec:
        def __getitem__(self, grid):
            return lambda *a, **k: log.append((saved, a, k))
    ulysses._copy5 = Rec()
    try:
        src = torch.empty(1, 8, 32, 1024, 128, device="meta", dtype=torch.bfloat16)
        dst = torch.empty(1, 8, 32, 1024, 128, device="meta", dtype=torch.bfloat16)
        ulysses.copy5(dst, src, config.default_config("layout_copy", torch.device("cuda"), torch.bfloat16, 128,
                                                      hip=True))
    finally:
        ulysses._copy5 = saved
    return log


def hip_defaults(dtype, d):
    dev = torch.device("cuda")
    return (config.default_config("flash_fwd", dev, dtype, d, hip=True),
            config.default_config("flash_bwd", dev, dtype, d, hip=True))


def report(target, dtype, d, causal, fwd, bwd, terms=None) -> list[tuple[str, dict]]:
    out = []
    for fn, args, kwargs in launches(dtype, d, causal, fwd, bwd, terms, hip=True):
        out.append((LABEL[fn.__name__], resources(compile_for(target, fn, args, kwargs))))
    return out


def compile_cases(name, target, cases) -> int:
    """Compile and print each (dtype, d, mask, terms) case at its ROCm defaults, then the layout copy; the most
    VGPRs any of them spilled."""
    t0, worst = time.time(), 0
    for dt, d, mask, terms in cases:
        fwd, bwd = hip_defaults(dt, d)
        for label, r in report(target, dt, d, terms is None or terms.causal, fwd, bwd, terms):
            worst = max(worst, r["spill"])
            print(f"{name} {str(dt)[6:]:8s} d{d:<3d} {mask:6s} {label:4s} {fmt(r)}", flush=True)
    for fn, args, kwargs in copy_launch():
        r = resources(compile_for(target, fn, args, kwargs))
        worst = max(worst, r["spill"])
        print(f"{name} bfloat16 layout copy    {fmt(r)}", flush=True)
    print(f"{name}: compiled in {time.time() - t0:.0f} s", flush=True)
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", default="defaults", choices=["defaults", "sweep", "one"])
    p.add_argument("--target", action="append", choices=sorted(TARGETS))
    a = p.parse_args()
    targets = a.target or ["gfx942", "gfx90a"]
    print(f"triton {triton.__version__}, AMD backend; s 8192, 32 / 8 heads; pointer tiles (no TMA on ROCm)",
          flush=True)
    worst = 0
    for name in targets:
        target = TARGETS[name]
        if a.what == "one":              # fp16 d64: causal forward and backward, one mask's, the layout copy
            worst = max(worst, compile_cases(name, target, [(torch.float16, 64, "causal", None),
                                                            (torch.float16, 64, "docs", MASKS["docs"])]))
        elif a.what == "defaults":
            cases = [(dt, d, "causal", None) for dt in (torch.bfloat16, torch.float16, torch.float32) for d in (64, 128)]
            cases += [(dt, d, mask, terms) for dt, d in ((torch.bfloat16, 128), (torch.float16, 64))
                      for mask, terms in MASKS.items()]
            worst = max(worst, compile_cases(name, target, cases))
        else:
            fwd0, bwd0 = hip_defaults(torch.bfloat16, 128)
            for bm, bn, w in ((128, 64, 8), (128, 64, 4), (128, 32, 4), (64, 64, 4), (64, 32, 4), (64, 16, 4)):
                fwd = dict(fwd0, BLOCK_M=bm, BLOCK_N=bn, num_warps=w)
                r = resources(compile_for(target, *launches(torch.bfloat16, 128, True, fwd, bwd0)[0]))
                print(f"{name} fwd {bm}x{bn} warps {w}: {fmt(r)}", flush=True)
            for m1, n1, w in ((32, 128, 4), (32, 64, 4), (16, 64, 4), (16, 32, 4), (32, 64, 8)):
                bwd = dict(bwd0, BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=n1, BLOCK_N2=m1, num_warps=w)
                got = launches(torch.bfloat16, 128, True, fwd0, bwd)
                r1, r2 = (resources(compile_for(target, *x)) for x in got[1:])
                print(f"{name} bwd dkdv {m1}x{n1} / dq {n1}x{m1} warps {w}: {fmt(r1)} | {fmt(r2)}", flush=True)
    if a.what != "sweep":
        print(f"most VGPRs spilled by any default: {worst}", flush=True)
    if a.what == "one" and worst != 0:
        sys.exit(1)


if __name__ == "__main__":
    main()

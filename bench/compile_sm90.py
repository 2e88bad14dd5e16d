"""Compile autosp's flash kernels for sm_90 (H100/H200) as a launch would, no GPU needed; report the
shared memory, registers and spills of each kernel.

    .venv/bin/python bench/compile_sm90.py                 # defaults: plain (3 dtypes x d 64/128/256), masked
    .venv/bin/python bench/compile_sm90.py plain|masked    # one of the two
    .venv/bin/python bench/compile_sm90.py sweep           # bf16 d=128 causal: candidate tilings, both paths

How: the real launchers (flash.attention_forward / attention_backward) run on meta tensors shaped
like a training call (b 1, 32 query / 8 KV heads, s 8192, contiguous) with the kernels replaced by
recorders; each recorded launch is compiled with Triton's ahead-of-time API (ASTSource +
GPUTarget(cuda, 90)) under the specialisation the JIT would give it (Triton's own
`native_specialize_impl`: an int equal to 1 becomes a constant, ints and pointers divisible by 16
carry that fact), so what compiles here is what a launch compiles there, TMA descriptors included.
The whole compiler runs, ptxas too; `ptxas -v` on the same PTX gives registers and spill bytes
(a spill is local-memory traffic in the inner loop: the thing to avoid). Triton 3.9 (and 3.6:
PYTHONPATH pointing at an unpacked 3.6 wheel).
"""
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # compiling needs the kernels jitted, not interpreted
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends import backends  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from autosp.kernels import config, flash  # noqa: E402
from autosp.kernels.maskterms import TileMask, recognise  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = backends["nvidia"].compiler
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
if not os.path.exists(PTXAS):  # Triton 3.6 names it plainly
    PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
KERNELS = ("_attn_fwd", "_bwd_dkdv", "_bwd_dq")
# the masks the sharding pass emits most: causal with document ids (two terms), transformers'
# packed documents with a window (four)
MASKS = {"docs": recognise("((k <= q) & (x0[q] == x1[k]))"),
         "hf-window": recognise("(((x0 & (x1[k] > x2[q])) & (x1[k] <= x3[q])) & (x4[q] == x5[k]))")}


class _Recorder:
    """Stands in for a jitted kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, fn, log):
        self.fn, self.log = fn, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append((self.fn, args, kwargs))


@contextlib.contextmanager
def recording():
    flash.load_kernels()
    log, saved = [], {name: getattr(flash, name) for name in KERNELS + ("_bwd_preprocess",)}
    for name, fn in saved.items():
        setattr(flash, name, _Recorder(fn, log))
    try:
        yield log
    finally:
        for name, fn in saved.items():
            setattr(flash, name, fn)


def launches(dtype, d, causal, fwd_cfg, bwd_cfg, terms=None, s=8192, heads=(32, 8), hip=False):
    """The kernels a forward and backward launch at these configs (`hip`: as on ROCm): [(jit fn, args, kwargs)]."""
    meta = dict(device="meta", dtype=dtype)
    q = torch.empty(1, heads[0], s, d, **meta)
    k, v = (torch.empty(1, heads[1], s, d, **meta) for _ in range(2))
    tiles = None if terms is None else TileMask(torch.zeros(len(terms.terms), 2, 1, s, dtype=torch.int64), s,
                                                terms.ops, terms.causal)
    if tiles is not None:
        fwd_cfg = flash.terms_forward_config(fwd_cfg, hip)   # what masked_attention launches
    scale = d ** -0.5
    with recording() as log:
        o, lse = flash.attention_forward(q, k, v, causal, scale, fwd_cfg, tiles)
        flash.attention_backward(o, q, k, v, o, lse, None, causal, scale, bwd_cfg, tiles)
    return [entry for entry in log if entry[0].__name__ in KERNELS]


def compile_launch(fn, args, kwargs, target=None, backend=None):
    """Compile one recorded launch (for sm_90 unless `target`, with that target's `backend` compiler) with the JIT's
    specialisation of its arguments."""
    target, backend = target or TARGET, backend or BACKEND
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(fn.arg_names, args)) | {k: v for k, v in kwargs.items() if k not in options}
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        value = values[name]
        if param.is_constexpr:
            signature[name], constexprs[(i,)] = "constexpr", value
            continue
        kind, key = native_specialize_impl(backend, value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = value
        elif key:
            attrs[(i,)] = backend.parse_attr(key)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target, options=options)


def resources(compiled) -> dict:
    """Shared memory (KB), registers per thread and spill bytes of a compiled kernel (ptxas -v)."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([PTXAS, "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a", ptx, "-o", ptx + ".o"],
                             capture_output=True, text=True)
    log = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return dict(smem=compiled.metadata.shared // 1024, regs=int(regs.group(1)) if regs else -1,
                spill=int(spills.group(1)) + int(spills.group(2)) if spills else -1)


def report(dtype, d, causal, fwd_cfg, bwd_cfg, terms=None) -> str:
    parts, t0 = [], time.time()
    for fn, args, kwargs in launches(dtype, d, causal, fwd_cfg, bwd_cfg, terms):
        r = resources(compile_launch(fn, args, kwargs))
        label = {"_attn_fwd": "fwd", "_bwd_dkdv": "dkdv", "_bwd_dq": "dq"}[fn.__name__]
        parts.append(f"{label} {r['smem']:3d} KB {r['regs']:3d} regs {r['spill']:5d} B spilled")
    return " | ".join(parts) + f"  ({time.time() - t0:.0f}s)"


def defaults(dtype, d):
    dev = torch.device("cuda")
    return (config.default_config("flash_fwd", dev, dtype, d, capability=(9, 0)),
            config.default_config("flash_bwd", dev, dtype, d, capability=(9, 0)))


DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def main(what: str) -> None:
    print(f"triton {triton.__version__}, sm_90, default configs; s 8192, 32 / 8 heads", flush=True)
    if what in ("all", "plain"):
        for dt in DTYPES:
            for d in (64, 128, 256):
                for causal in (True, False):
                    line = report(dt, d, causal, *defaults(dt, d))
                    print(f"{str(dt)[6:]:9s} d{d:<3d} {'causal' if causal else 'full  '} {line}", flush=True)
    if what in ("all", "masked"):
        for dt, d in ((torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 128)):
            for label, terms in MASKS.items():
                line = report(dt, d, terms.causal, *defaults(dt, d), terms)
                print(f"{str(dt)[6:]:9s} d{d:<3d} {label:9s} ({len(terms.terms)} terms) {line}", flush=True)
    if what == "sweep":
        fwd0, bwd0 = defaults(torch.bfloat16, 128)
        for tma in (1, 0):
            for bm, bn, w in ((128, 128, 8), (128, 64, 8), (128, 64, 4), (64, 64, 4)):
                fwd = dict(fwd0, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, TMA=tma)
                r = resources(compile_launch(*launches(torch.bfloat16, 128, True, fwd, bwd0)[0]))
                print(f"fwd tma={tma} {bm}x{bn} warps {w}: {r}", flush=True)
            for m1, n1, w in ((32, 64, 8), (16, 64, 8), (32, 128, 8), (32, 128, 4), (64, 64, 8), (32, 64, 4)):
                bwd = dict(bwd0, BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=n1, BLOCK_N2=m1, num_warps=w, TMA=tma)
                got = launches(torch.bfloat16, 128, True, fwd0, bwd)
                r1, r2 = (resources(compile_launch(*x)) for x in got[1:])
                print(f"bwd tma={tma} dkdv {m1}x{n1} / dq {n1}x{m1} warps {w}: {r1} {r2}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all")

"""Autotune autosp's Triton flash attention (forward and backward) and write the config cache.

    python bench/autotune_attention.py                       # bf16, d=128, causal, s 2k..32k
    python bench/autotune_attention.py --dtypes bf16,fp16 --head-dims 64,128 --seqs 4096,16384 --full
    AUTOSP_KERNEL_CONFIGS=cfg.json python bench/autotune_attention.py --quick

Entries are keyed (kernel, device name, dtype, head dim, causal, sequence bucket) and
merged into --out (default: $AUTOSP_KERNEL_CONFIGS or ~/.cache/autosp/kernel_configs.json),
which `autosp.kernels.config.lookup` reads at run time; shapes without an entry use the
nearest tuned bucket, then the defaults. Each candidate must reproduce the default
config's result before it may win. On a machine without a GPU the search runs tiny
shapes through the Triton interpreter (a smoke test of this script, not a tuning).
"""
import argparse
import sys
import time
from pathlib import Path

import torch

from autosp.kernels import config
from autosp.kernels.tuning import tune_attention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bf16")
    p.add_argument("--head-dims", default="128")
    p.add_argument("--seqs", default="2048,4096,8192,16384,32768")
    p.add_argument("--causal", default="1", help="1, 0 or 1,0")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16384, help="batch = max(1, tokens // seq)")
    p.add_argument("--kernels", default="fwd,bwd")
    p.add_argument("--full", action="store_true", help="the whole search space (slow); default: quick")
    p.add_argument("--quick", action="store_true", help="the quick space (the default)")
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:  # interpreter smoke test: tiny shapes, fp16/fp32 only (bf16 is broken there)
        print("no GPU: smoke-testing the search on CPU tensors through the Triton interpreter")
        a.seqs, a.heads, a.kv_heads, a.tokens, a.rep_ms = "64", 2, 1, 64, 1
        a.dtypes = ",".join(x for x in a.dtypes.split(",") if x != "bf16") or "fp16"
    out = a.out or config.cache_path()
    entries, t0 = {}, time.time()
    for dt, d, causal, s in ((DTYPES[x], int(d), bool(int(c)), int(s)) for x in a.dtypes.split(",")
                             for d in a.head_dims.split(",") for c in a.causal.split(",") for s in a.seqs.split(",")):
        b = max(1, a.tokens // s)
        print(f"== {config.dtype_name(dt)} d={d} causal={causal} s={s} b={b} hq={a.heads} hkv={a.kv_heads}",
              flush=True)
        found = tune_attention(b, a.heads, a.kv_heads, s, d, dt, causal, device, which=a.kernels.split(","),
                               quick=not a.full, rep_ms=a.rep_ms, log=lambda m: print(m, flush=True))
        entries.update(found)
        if found:
            config.save_entries(found, out)  # as we go: a timeout keeps what was found
    print(f"wrote {len(entries)} entries to {out} in {time.time() - t0:.0f}s")
    return 0 if entries else 1


if __name__ == "__main__":
    sys.exit(main())

"""Autotune the Ulysses layout copy (pack / unpack around the all-to-all) and write the config cache.

    python bench/autotune_a2a.py                     # bf16, d=128, Llama-8B heads, world 8
    python bench/autotune_a2a.py --s-locs 1024,4096 --world 4 --dtypes bf16,fp16 --out cfg.json

Entries are keyed (layout_copy, device name, dtype, head dim, -, bucket of s/P) and merged
into --out (default: $AUTOSP_KERNEL_CONFIGS or ~/.cache/autosp/kernel_configs.json). A
candidate must reproduce torch's copy bit for bit before it may win. Without a GPU this
smoke-tests the search through the Triton interpreter.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

from autosp.kernels import config
from autosp.kernels.tuning import tune_copy

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bf16")
    p.add_argument("--head-dims", default="128")
    p.add_argument("--s-locs", default="1024,4096,16384", help="per-rank sequence lengths s/P")
    p.add_argument("--heads", default="32,8,8", help="Q, K, V head counts")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--full", action="store_true")
    p.add_argument("--quick", action="store_true", help="the quick space (the default)")
    p.add_argument("--rep-ms", type=int, default=30)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda:
        print("no GPU: smoke-testing the search on CPU tensors through the Triton interpreter")
        a.s_locs, a.heads, a.world, a.rep_ms = "16", "4,2,2", 2, 1
        a.dtypes = ",".join(x for x in a.dtypes.split(",") if x != "bf16") or "fp16"
    out = a.out or config.cache_path()
    heads = [int(h) for h in a.heads.split(",")]
    entries, t0 = {}, time.time()
    for x in a.dtypes.split(","):
        for d in (int(v) for v in a.head_dims.split(",")):
            for s_loc in (int(v) for v in a.s_locs.split(",")):
                print(f"== {x} d={d} s_loc={s_loc} heads={heads} world={a.world} b={a.batch}", flush=True)
                found = tune_copy(a.batch, heads, s_loc, d, a.world, DTYPES[x], "cuda" if cuda else "cpu",
                                  quick=not a.full, rep_ms=a.rep_ms, log=lambda m: print(m, flush=True))
                entries.update(found)
                if found:
                    config.save_entries(found, out)
    print(f"wrote {len(entries)} entries to {out} in {time.time() - t0:.0f}s")
    return 0 if entries else 1


if __name__ == "__main__":
    sys.exit(main())

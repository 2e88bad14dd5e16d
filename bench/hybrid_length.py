"""A hybrid's longest trainable length against a dense model's of the same shape: the plan's per-rank peak at
several lengths (autosp.plan, no remat, sp ranks, CPU cost model), the line through the two longest, where it
crosses --memory, and the plan at that length to check it.

    .venv/bin/python bench/hybrid_length.py --sp 2 --memory 64MiB --names llama qwen3_5 mamba2

The hybrids' torch reference paths loop over chunks, so `autosp plan` (which fits two traces of one program)
refuses them; each length here is its own trace, and the line is checked at the length it gives.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.dist import run_ranks  # noqa: E402


def _job(rank, world, name, lengths, memory):
    import autosp
    from torch.distributed.device_mesh import init_device_mesh
    from tests.models import batch
    from tests.zoo import build
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    model, fn = build(name)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def peak(s):
        ids, labels = batch(1, s, 64, seed=1)
        return autosp.plan(fn, mesh, params, ids, labels).peak_bytes
    peaks = {s: peak(s) for s in lengths}
    (a, pa), (b, pb) = sorted(peaks.items())[-2:]
    slope = (pb - pa) / (b - a)
    longest = int((memory - pb) / slope + b) // (8 * world) * (8 * world)
    return {"params": sum(p.numel() for p in params.values()), "peaks": peaks, "per_token": slope,
            "longest": longest, "checked": peak(longest)}


def main():
    from autosp.run.config import parse_size
    ap = argparse.ArgumentParser()
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--memory", default="64MiB")
    ap.add_argument("--names", nargs="+", default=["llama", "qwen3_5", "mamba2"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    a = ap.parse_args()
    memory = parse_size(a.memory, "--memory")
    print(f"| model | parameters | plan's peak per rank at {', '.join(f'{s:,}' for s in a.lengths)} | bytes per token "
          f"| longest at {a.memory} (sp {a.sp}) | its plan's peak |")
    print("|---|---|---|---|---|---|")
    for name in a.names:
        r = run_ranks(_job, a.sp, name, a.lengths, memory, timeout=3600)[0]
        print(f"| {name} | {r['params']:,} | {', '.join(f'{p / 2**20:.2f}' for p in r['peaks'].values())} MiB | "
              f"{r['per_token']:,.0f} | {r['longest']:,} | {r['checked'] / 2**20:.2f} MiB |", flush=True)


if __name__ == "__main__":
    main()

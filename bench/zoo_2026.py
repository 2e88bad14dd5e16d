"""2026's architectures (tests/zoo.py's 2026 entries) sharded: exactness, per-rank peak and step time against
one device, at sp 2 and 4 (CPU, gloo, fp32, their torch code paths).

    .venv/bin/python bench/zoo_2026.py --seq 512 --sp 2 4 [--names minimax gpt_oss]

Peaks: bytes allocated above what was live before the step (autosp.memory.peak_bytes); times: the median of
--repeat steps after one warm-up (forward + backward), each rank running 1 thread, the single device too.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.dist import run_ranks  # noqa: E402


def _steps(step, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _job(rank, world, name, seq, repeat):
    import autosp
    from autosp.memory import peak_bytes
    from torch.distributed.device_mesh import init_device_mesh
    from tests.models import batch
    from tests.zoo import build
    model, fn = build(name)                           # tests/zoo.py's tiny configs: hidden 32, two layers
    params = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}
    ids, labels = batch(1, seq, 64, seed=1)
    res = {}

    def single():
        loss = fn(params, ids, labels)
        loss.backward()
        return loss.detach(), None
    if rank == 0:
        single()
        res["single"], (ref, _) = peak_bytes(single)
        res["single_time"] = _steps(single, repeat)
        res["ref"] = ref.item()
    for v in params.values():
        v.grad = None
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    step = autosp.shard(fn, mesh)

    def sharded():
        loss = step(params, ids, labels)
        loss.backward()
        return loss.detach(), None
    sharded()
    res["sp"], (loss, _) = peak_bytes(sharded)
    res["sp_time"] = _steps(sharded, repeat)
    res["loss"] = loss.item()
    return res


def main():
    from tests.zoo import NAMES_2026
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--sp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--names", nargs="+", default=NAMES_2026)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    print("| model | s | sp | one device: peak, step | per rank (max): peak, step | peak ratio | time ratio | "
          "loss sp - one device |")
    print("|---|---|---|---|---|---|---|---|")
    for name in a.names:
        for p in a.sp:
            out = run_ranks(_job, p, name, a.seq, a.repeat, timeout=3600)
            one, peak = out[0], max(r["sp"] for r in out)
            t = max(r["sp_time"] for r in out)
            print(f"| {name} | {a.seq} | {p} | {one['single'] / 2**20:.2f} MiB, {one['single_time']:.3f} s | "
                  f"{peak / 2**20:.2f} MiB, {t:.3f} s | {peak / one['single']:.3f} | {t / one['single_time']:.2f} | "
                  f"{out[0]['loss'] - one['ref']:+.1e} |", flush=True)


if __name__ == "__main__":
    main()

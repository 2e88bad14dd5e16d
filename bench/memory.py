"""Per-rank peak memory of one training step (forward + backward), autosp at SP=P vs one device.

    .venv/bin/python bench/memory.py --seq 2048 --sp 2 4

Peaks: bytes allocated above what was live before the step (autosp.memory.peak_bytes, the profiler's
allocation events); the single-device step runs on rank 0.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.dist import run_ranks  # noqa: E402


def build(seq, layers, hidden, vocab):
    from tests.models import batch, llama_loss, params_of, tiny_llama
    torch.manual_seed(0)
    model = tiny_llama(layers=layers, vocab=vocab, hidden=hidden, heads=8, kv_heads=4)
    ids, labels = batch(1, seq, vocab, pad=5)
    return llama_loss(model), params_of(model), ids, labels


def _job(rank, world, seq, layers, hidden, vocab):
    import autosp
    from autosp.memory import peak_bytes
    from torch.distributed.device_mesh import init_device_mesh
    fn, params, ids, labels = build(seq, layers, hidden, vocab)
    live = {k: v.requires_grad_(True) for k, v in params.items()}
    res = {}
    if rank == 0:
        def single():
            loss = fn(live, ids, labels)
            loss.backward()
            return loss.detach(), None
        res["single"], (ref, _) = peak_bytes(single, *live.values(), ids, labels)
        res["ref"] = ref.item()
        for v in live.values():
            v.grad = None
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    step = autosp.shard(fn, mesh)
    step(live, ids, labels)                       # compile outside the measurement
    for v in live.values():
        v.grad = None

    def sharded():
        loss = step(live, ids, labels)
        loss.backward()
        return loss.detach(), None
    res["sp"], (loss, _) = peak_bytes(sharded, *live.values(), ids, labels)
    res["loss"] = loss.item()
    return res


def measure(seq, sp, layers=2, hidden=256, vocab=512):
    """{'single': bytes, 'sp': [bytes per rank], 'loss', 'ref'}"""
    out = run_ranks(_job, sp, seq, layers, hidden, vocab)
    return {"single": out[0]["single"], "sp": [r["sp"] for r in out], "loss": out[0]["loss"], "ref": out[0]["ref"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--sp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    a = ap.parse_args()
    print("| s | SP | single-device peak | per-rank peak (max) | ratio | loss (sp / single) |")
    print("|---|---|---|---|---|---|")
    for p in a.sp:
        m = measure(a.seq, p, a.layers, a.hidden)
        worst = max(m["sp"])
        print(f"| {a.seq} | {p} | {m['single'] / 2**20:.1f} MiB | {worst / 2**20:.1f} MiB | "
              f"{worst / m['single']:.3f} | {m['loss']:.6f} / {m['ref']:.6f} |")


if __name__ == "__main__":
    main()

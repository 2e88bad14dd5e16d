"""Per-rank peak memory and step time of masked attention: causal, sliding window, packed documents.

    .venv/bin/python bench/masks.py --seqs 4096 8192 16384 --sp 2
    .venv/bin/python bench/masks.py --seqs 4096 8192 --sp 2 --dense      # also the s x s mask path

A 2-layer Llama-style model (HF Llama / Mistral, hidden 128, 4 heads of 32, 2 KV heads), batch 1:
  causal   Llama, no position_ids: SDPA's causal kernel (the flash path, no mask tensor)
  window   Mistral with sliding_window = s/8: the mask a function (q - k window), no s x s tensor
  packed   Llama with position_ids restarting per document (8 documents of random lengths)
--dense repeats window and packed with mask functions off (AUTOSP_MASK_FUNCTIONS=0): the mask is
built s x s on every rank, as before. Peaks from the profiler's allocation events (autosp/memory.py)
over one forward + backward after a compile step; time: median of --steps steps.
"""
import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.dist import run_ranks  # noqa: E402


def packed_positions(s: int, docs: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(s - 1, generator=g)[:docs - 1].add(1).sort().values.tolist()
    bounds = [0] + cuts + [s]
    return torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])[None]


def build(case: str, s: int):
    from tests.models import tiny_hf, tiny_llama
    torch.manual_seed(0)
    common = dict(layers=2, vocab=256, hidden=128, heads=4, kv_heads=2)
    model = tiny_hf("mistral", sliding_window=s // 8, **common) if case == "window" else tiny_llama(**common)
    ids = torch.randint(0, 256, (1, s), generator=torch.Generator().manual_seed(1))
    extra = {"position_ids": packed_positions(s, 8)} if case == "packed" else {}

    def loss_fn(params, input_ids, labels, *pos):
        kw = {"labels": labels, "use_cache": False}
        if pos:
            kw["position_ids"] = pos[0]
        return torch.func.functional_call(model, params, (input_ids,), kw).loss
    params = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}
    return loss_fn, params, (ids, ids.clone()) + tuple(extra.values())


@contextmanager
def _mask_functions(on: bool):
    """AUTOSP_MASK_FUNCTIONS for one job only: the rank processes are a pool that runs every later row."""
    before = os.environ.get("AUTOSP_MASK_FUNCTIONS")
    os.environ["AUTOSP_MASK_FUNCTIONS"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["AUTOSP_MASK_FUNCTIONS"]
        else:
            os.environ["AUTOSP_MASK_FUNCTIONS"] = before


def _job(rank, world, case, s, steps, dense):
    with _mask_functions(not dense):
        return _measure(world, case, s, steps)


def _measure(world, case, s, steps):
    import autosp
    from autosp.memory import peak_bytes
    from torch.distributed.device_mesh import init_device_mesh
    fn, params, args = build(case, s)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    step = autosp.shard(fn, mesh)

    def one():
        loss = step(params, *args)
        loss.backward()
        for v in params.values():
            v.grad = None
        return loss.detach()
    one()                                         # compile outside the measurements
    peak, loss = peak_bytes(one)
    times = []
    for _ in range(steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        one()
        times.append(time.perf_counter() - t0)
    (local, *_), = step._cache.values()
    kinds = sorted({e.op.name for e in local.eqns if e.op.name in ("attention", "masked_attention")})
    return {"peak": peak, "time": statistics.median(times), "loss": loss.item(), "ops": kinds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--cases", nargs="+", default=["causal", "window", "packed"])
    p.add_argument("--dense", action="store_true", help="also window and packed with the s x s mask")
    a = p.parse_args()
    runs = [(c, False) for c in a.cases] + ([(c, True) for c in a.cases if c != "causal"] if a.dense else [])
    rows = {}
    for s in a.seqs:
        for case, dense in runs:
            out = run_ranks(_job, a.sp, case, s, a.steps, dense, timeout=3600)
            peak = max(r["peak"] for r in out)
            name = case + (" (s x s mask)" if dense else "")
            rows[(name, s)] = (peak, out[0]["time"], out[0]["ops"])
            print(f"s={s:6d} {name:22s} peak/rank {peak / 2**20:9.1f} MiB  step {out[0]['time']:7.2f} s  "
                  f"loss {out[0]['loss']:.4f}  {out[0]['ops']}", flush=True)
    print("\n| case | " + " | ".join(f"s={s} peak MiB / step s" for s in a.seqs) + " |")
    print("|---|" + "---|" * len(a.seqs))
    for name in dict.fromkeys(n for n, _ in rows):
        cells = [f"{rows[(name, s)][0] / 2**20:.1f} / {rows[(name, s)][1]:.2f}" if (name, s) in rows else "-"
                 for s in a.seqs]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name in dict.fromkeys(n for n, _ in rows):
        for s0, s1 in zip(a.seqs, a.seqs[1:]):
            if (name, s0) in rows and (name, s1) in rows:
                print(f"{name}: peak s={s1} / s={s0} = {rows[(name, s1)][0] / rows[(name, s0)][0]:.2f}")
        for s in a.seqs:
            if name != "causal" and ("causal", s) in rows and (name, s) in rows:
                print(f"{name} / causal at s={s}: peak {rows[(name, s)][0] / rows[('causal', s)][0]:.2f}, "
                      f"time {rows[(name, s)][1] / rows[('causal', s)][1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

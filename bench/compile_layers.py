"""The first call of a compiled step (inductor, cache empty) as layers are added: the tests' Llama on one rank.

    .venv/bin/python bench/compile_layers.py [--layers 8 --seq 1024 --budget least]

The step as tests/test_inductor.py builds it (HF Llama, hidden 64, 4 / 2 heads, vocab 128, fp32), one gloo rank,
one thread, TORCHINDUCTOR_CACHE_DIR a new folder: the first call's seconds (planning excluded, compiling included),
the programs' segments and how many of them were different code (compiled once each), the worst relative error of
the loss and gradients against the single device, the profiler's peak against the plan, and the median of 5 steps
after. Run it in two checkouts to compare code.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import command  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--budget", default="least", help="memory_budget: a fraction, or least")
    a = ap.parse_args(argv)
    print(f"# {command(__file__, argv)}", flush=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29617")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autosp
    from autosp.memory import peak_bytes
    from tests.models import batch, llama_loss, params_of, reference, tiny_llama
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("sp",))
    torch.manual_seed(0)
    model = tiny_llama(layers=a.layers, hidden=64, heads=4, kv_heads=2, vocab=128)
    fn, params = llama_loss(model), params_of(model)
    ids, labels = batch(1, a.seq, 128, pad=5)
    budget = a.budget if a.budget == "least" else float(a.budget)
    vg = autosp.value_and_grad(fn, mesh, memory_budget=budget, compile=True)
    plan = vg.sharded.plan(autosp.api._differentiable(params), ids, labels)
    t0 = time.perf_counter()
    loss, grads = vg(params, ids, labels)
    first = time.perf_counter() - t0
    ref_loss, ref_grads = reference(fn, params, ids, labels)
    err = max([abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))]
              + [float((grads[k] - g).norm() / g.norm()) for k, g in ref_grads.items() if g.norm() > 0])
    measured, _ = peak_bytes(lambda: vg(params, ids, labels))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        vg(params, ids, labels)
        times.append(time.perf_counter() - t0)
    (runner,) = [r for _, r, _, _ in vg.sharded._cache.values()]
    fwd, bwd = runner.forward, runner.backward
    print(f"{a.layers} layers, s = {a.seq}, budget {a.budget}: first call {first:.1f} s; segments {len(fwd.segments)} "
          f"+ {len(bwd.segments)}, of different code {getattr(fwd, 'unique', '?')} + {getattr(bwd, 'unique', '?')}; "
          f"worst error {err:.1e}; peak {measured:,} B against the plan's {plan.peak_bytes:,} "
          f"({measured - plan.peak_bytes:+,} B); step median {statistics.median(times):.3f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

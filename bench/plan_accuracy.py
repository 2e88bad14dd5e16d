"""How well `autosp plan`'s memory model predicts the measured per-rank peak of a training step.

    .venv/bin/python bench/plan_accuracy.py [--model tiny] [--sp 2] [--seq 2048 4096 8192] [--budget 0.5]

Predicted (one process, meta tensors, a fake world of SP ranks: what `autosp plan` computes):
  no remat  the affine model of the step's bytes, fitted on two traces at other lengths (--fit)
  ILP plan  the plan autosp makes at each length for a byte budget of --budget x the no-remat peak
Measured (SP real gloo ranks on CPU, the same model, real tokens of the default corpus): the step's
peak bytes above what was live before it, from the profiler's allocation events
(autosp.memory.peak_bytes), the largest over the ranks; for no remat both ways autosp runs it:
memory_budget=None (autograd's own graph: what `autosp train` runs without --memory-budget) and
memory_budget=1.0 (the joint program with everything saved: what the planner models).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import command  # noqa: E402


def predict(model: str, sp: int, seqs, fit, budget: float, device: str = "cpu"):
    from autosp.run.meshes import fake_world, planning_mesh
    from autosp.run.models import model_config
    from autosp.run.plan import Affine, Tracer, _step, probe
    out = {}
    with fake_world(sp):
        tracer = Tracer(model_config(model), planning_mesh(sp), torch.float32, 1, sp)
        q = probe(tracer, fit[0], fit[1], device, False, parallel=False)
        aff = Affine.fit(fit[0], q.profiles[("sp", fit[0])].values, fit[1], q.profiles[("sp", fit[1])].values)
        for s in seqs:
            none = aff.peak(s)
            plan, _ = _step(tracer.trace(s).local, int(budget * none), device)
            out[s] = {"none": int(none), "budget": int(budget * none), "plan": plan.peak_bytes}
    return out


def _job(rank, world, model, seqs, budgets):
    from torch.distributed.device_mesh import init_device_mesh

    import autosp
    from autosp.memory import peak_bytes
    from autosp.run.data import batch_for_step, open_corpus
    from autosp.run.models import build_model, model_config

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    net = build_model(model_config(model), seed=0)
    params = dict(net.named_parameters())

    def loss_fn(params, input_ids, labels):
        return torch.func.functional_call(net, params, (input_ids,), {"labels": labels}).loss

    corpus = open_corpus(None)
    rows = {}
    for s in seqs:
        ids = torch.from_numpy(batch_for_step(corpus, seq_len=s, batch=1, step=0, seed=0))
        row = {}
        for name, budget in (("none", None), ("all saved", 1.0), ("plan", budgets[s])):
            f = autosp.value_and_grad(loss_fn, mesh, memory_budget=budget)
            f(params, ids, ids)                                    # compile (and plan) outside the measurement
            peak, _ = peak_bytes(lambda f=f: f(params, ids, ids))
            peaks = [None] * world
            torch.distributed.all_gather_object(peaks, peak)
            row[name] = max(peaks)
        rows[s] = row
    return rows


def main(argv=None):
    os.environ["AUTOSP_PLAN_CACHE"] = "off"     # planned afresh, not read from the plan cache: planning is timed
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192], help="global lengths")
    ap.add_argument("--fit", type=int, nargs=2, default=[1024, 16384], help="the two traced lengths")
    ap.add_argument("--budget", type=float, default=0.5, help="ILP budget as a fraction of the no-remat peak")
    args = ap.parse_args(argv)
    from tests.dist import run_ranks
    print("# " + command(__file__, argv), flush=True)
    t0 = time.perf_counter()
    pred = predict(args.model, args.sp, args.seq, args.fit, args.budget)
    t1 = time.perf_counter()
    meas = run_ranks(_job, args.sp, args.model, args.seq, {s: pred[s]["budget"] for s in args.seq},
                     timeout=3600)[0]
    print(f"# predicted in {t1 - t0:.0f} s (fitted at {args.fit}), measured in {time.perf_counter() - t1:.0f} s; "
          f"--model {args.model}, SP={args.sp}, fp32, batch 1, torch {torch.__version__}\n")
    print("| global length | no remat: predicted (B) | measured, budget None (B) | measured, budget 1.0 (B) | error "
          "| ILP budget (B) | ILP: predicted (B) | measured (B) | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in args.seq:
        p, m = pred[s], meas[s]
        worst = max(abs(p["none"] - m["none"]), abs(p["none"] - m["all saved"])) / m["none"]
        print(f"| {s} | {p['none']:,} | {m['none']:,} | {m['all saved']:,} | {100 * worst:.4f} % | {p['budget']:,} | "
              f"{p['plan']:,} | {m['plan']:,} | {100 * abs(p['plan'] - m['plan']) / m['plan']:.4f} % |")


if __name__ == "__main__":
    main()

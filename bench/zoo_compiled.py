"""The model zoo (tests/zoo.py) at SP = 2 through inductor (compile=True): every rank's loss and gradients
against the single device, fp32, and the worst element's relative error; the compile time of each model.

    .venv/bin/python bench/zoo_compiled.py [--names llama,mistral] [--s 45] [--budget 1.0]

As tests/test_zoo.py (SP = 2 at a length 2 does not divide), each model's step compiled at `--budget` (1.0:
what autograd saves; compile=True always runs a plan). Errors are relative to the reference's largest entry
(tests.models.rank_errors), the suite's tolerance is 1e-5.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from bench import command  # noqa: E402


def _job(rank, world, names, s, budget):
    import autosp
    from torch.distributed.device_mesh import init_device_mesh
    from tests.models import rank_errors
    from tests.zoo import case
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    out = {}
    for name in names:
        _, fn, params, (ids, labels), ref, ref_grads = case(name, s)
        t0 = time.perf_counter()
        try:
            vg = autosp.value_and_grad(fn, mesh, memory_budget=budget, compile=True)
            loss, grads = vg(params, ids, labels)
        except Exception as exc:                     # a model that does not compile: reported, not hidden
            lines = str(exc).splitlines()
            where = next((line for line in lines if line.startswith("Error in op:")), "")
            out[name] = {"error": f"{type(exc).__name__}: {lines[0][:200]} {where}".strip()}
            continue
        errors = rank_errors(loss, grads, ref, ref_grads)
        worst = max(errors, key=errors.get)
        out[name] = {"worst": errors[worst], "where": worst, "seconds": time.perf_counter() - t0}
    return out


def main(argv=None) -> None:
    # planned afresh, not read from the plan cache: the first step is timed, planning included
    os.environ["AUTOSP_PLAN_CACHE"] = "off"
    from tests.dist import run_ranks
    from tests.zoo import NAMES
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--names", default=",".join(NAMES))
    ap.add_argument("--s", type=int, default=45)
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--budget", default="1.0")
    a = ap.parse_args(argv)
    budget = a.budget if a.budget == "least" else float(a.budget)
    print(f"# {command(__file__, argv)}", flush=True)
    t0 = time.perf_counter()
    res = run_ranks(_job, a.sp, a.names.split(","), a.s, budget, timeout=7200)
    print("\n| model | worst relative error (every rank) | where | compile + first step, rank 0 |")
    print("|---|---|---|---|")
    bad = 0
    for name in a.names.split(","):
        rows = [r[name] for r in res]
        if any("error" in r for r in rows):
            bad += 1
            print(f"| {name} | {next(r['error'] for r in rows if 'error' in r)} |  |  |")
            continue
        worst = max(rows, key=lambda r: r["worst"])
        bad += worst["worst"] > 1e-5
        print(f"| {name} | {worst['worst']:.2e} | {worst['where']} | {rows[0]['seconds']:.0f} s |")
    print(f"\n{len(a.names.split(',')) - bad} of {len(a.names.split(','))} within 1e-5; "
          f"wall {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()

"""What `autosp train` costs before its steps, cold and warm: inductor's on-disk cache and autosp's plan cache empty,
then the same run again with the caches the first one filled.

    .venv/bin/python bench/compile_cost.py [--model tiny --sp 2 --seq-len 4096 --pairs 1 --memory 24MiB] [--no-compile]

Each pair is two runs of `autosp train --model MODEL --sp SP --seq-len L --batch 1 --steps 2 [--compile]` in fresh run
folders, with TORCHINDUCTOR_CACHE_DIR and AUTOSP_PLAN_CACHE pointing at folders of the pair's own (empty before its
first run). The figures are what the command prints after its first step (the seconds its programs took to compile,
summed over the programs of rank 0, and whether inductor's cache served them; whether the memory plan was read from
the plan cache), its second step's time, and the wall time of the command; pairs one after the other, the medians
last.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import command  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--pairs", type=int, default=1, help="cold-warm pairs, one after the other")
    ap.add_argument("--memory", default=None, help="per-rank memory, as autosp train --memory (default: none, no plan)")
    ap.add_argument("--no-compile", action="store_true", help="eager: the plan cache alone")
    a = ap.parse_args(argv)
    print(f"# {command(__file__, argv)}", flush=True)
    rows = []
    for pair in range(a.pairs):
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                       AUTOSP_PLAN_CACHE=os.path.join(tmp, "plans"), PYTHONPATH=ROOT)
            for n, kind in enumerate(("cold", "warm")):
                rows.append((pair + 1, kind) + _run(a, env, os.path.join(tmp, f"run{n}")))
                print("pair {} {}: compiled {}; plan {}; step 1 {:.1f} s, step 2 {:.2f} s; wall {:.1f} s".format(
                    *rows[-1][:2], "-" if rows[-1][2] is None else f"{rows[-1][2]:.1f} s ({rows[-1][3]})", *rows[-1][4:]),
                    flush=True)
    print("\n| pair | run | compile (rank 0's programs) | inductor's cache | memory plan | step 1 | step 2 | command wall |")
    print("|---|---|---|---|---|---|---|---|")
    for pair, kind, secs, cache, plan, s1, s2, wall in rows:
        print(f"| {pair} | {kind} | {'-' if secs is None else f'{secs:.1f} s'} | {cache or '-'} | {plan} | {s1:.1f} s | "
              f"{s2:.2f} s | {wall:.1f} s |")
    for kind in ("cold", "warm"):
        walls = [r[-1] for r in rows if r[1] == kind]
        print(f"median wall, {kind}: {statistics.median(walls):.1f} s over {len(walls)}")


def _run(a, env, out):
    """(compile seconds, inductor's cache, where the plan came from, step 1 s, step 2 s, wall s) of one run."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "autosp", "train", "--model", a.model, "--sp", str(a.sp),
                        "--seq-len", str(a.seq_len), "--batch", "1", "--steps", "2", "--out", out, "--timeout", "1200",
                        *([] if a.no_compile else ["--compile"]), *(["--memory", a.memory] if a.memory else [])],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"{out} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    m = re.search(r"compiled by inductor in ([0-9.]+) s \(([^)]*)\)", p.stdout)
    plan = ("none" if not a.memory else "read from the cache" if "from the plan cache" in p.stdout else "planned")
    steps = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return (float(m.group(1)) if m else None, m.group(2) if m else None, plan, steps[0]["step_s"], steps[1]["step_s"],
            wall)


if __name__ == "__main__":
    main()

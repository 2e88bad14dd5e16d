"""What `autosp train --compile` costs at its first step, cold and warm: inductor's on-disk cache empty, then the
same run again with the cache the first one filled.

    .venv/bin/python bench/compile_cost.py [--model tiny --sp 2 --seq-len 4096 --runs 2 --memory 24MiB]

Each run is `autosp train --model MODEL --sp SP --seq-len L --batch 1 --steps 2 --compile` in a fresh run folder,
with TORCHINDUCTOR_CACHE_DIR pointing at one temporary folder for all runs (empty before the first); the figures are
what the command prints after its first step (the seconds its programs took to compile, summed over the programs
of rank 0, and whether inductor's cache served them), its second step's time, and the wall time of the command.
"""
from __future__ import annotations

import argparse
import json
import os
import re
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
    ap.add_argument("--runs", type=int, default=2, help="the first cold, the rest warm")
    ap.add_argument("--memory", default=None, help="per-rank memory, as autosp train --memory (default: none, no plan)")
    a = ap.parse_args(argv)
    print(f"# {command(__file__, argv)}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"), PYTHONPATH=ROOT)
        for n in range(a.runs):
            out = os.path.join(tmp, f"run{n}")
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "autosp", "train", "--model", a.model, "--sp", str(a.sp),
                                "--seq-len", str(a.seq_len), "--batch", "1", "--steps", "2", "--compile", "--out", out,
                                "--timeout", "1200", *(["--memory", a.memory] if a.memory else [])], capture_output=True, text=True, env=env, cwd=ROOT)
            wall = time.perf_counter() - t0
            if p.returncode != 0:
                sys.exit(f"run {n} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
            m = re.search(r"compiled by inductor in ([0-9.]+) s \(([^)]*)\)", p.stdout)
            steps = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
            rows.append((n, float(m.group(1)), m.group(2), steps[0]["step_s"], steps[1]["step_s"], wall))
            print(f"run {n}: compiled in {m.group(1)} s ({m.group(2)}); step 1 {steps[0]['step_s']:.1f} s, "
                  f"step 2 {steps[1]['step_s']:.2f} s; wall {wall:.0f} s", flush=True)
    print("\n| run | inductor's cache | compile (rank 0's programs) | step 1 (compile included) | step 2 | command wall |")
    print("|---|---|---|---|---|---|")
    for n, secs, kind, s1, s2, wall in rows:
        print(f"| {n + 1} | {kind} | {secs:.1f} s | {s1:.1f} s | {s2:.2f} s | {wall:.0f} s |")


if __name__ == "__main__":
    main()

"""The planner's promise, measured: `autosp plan` and `autosp train` as one tool.

For every case (a model, a memory size per rank, with or without --offload, fp32 or bf16, sp 2 on CPU):

  1. `autosp plan --memory M` answers the longest length L and ends with the `autosp train` command that runs it;
  2. that command runs 3 steps: the measured peak per rank (the profiler's allocation events, model state
     included: autosp.memory.StepMeter) must be at most M and within 5 % of the prediction;
  3. the same command at L + one granule (sp x 64 tokens) must exit 2 before training, naming L.

On a GPU (`--device cuda --sp 1`, bench/gpu_check.sh) the peak is torch.cuda.max_memory_allocated, per step.

    .venv/bin/python bench/plan_vs_train.py                      # the matrix (tiny and small; about an hour)
    .venv/bin/python bench/plan_vs_train.py --models tiny --precisions fp32 --offload no

Prints a markdown table (the one in bench/RESULTS.md) and writes OUT/results.jsonl and each command's output
under OUT (default bench/out/plan_vs_train).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMORY = {"tiny": ["32MiB", "64MiB"], "small": ["320MiB", "384MiB"]}
HOST = "2GiB"                   # per node with --offload: 1 GiB per rank at sp 2


def run(argv: list[str], log: str) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "autosp", *argv], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    with open(log, "w") as f:
        f.write("$ autosp " + shlex.join(argv) + "\n" + p.stdout + "\n--- stderr ---\n" + p.stderr)
    return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0


def case(model: str, memory: str, offload: bool, precision: str, out: str, sp: int = 2, device: str = "cpu",
         refuse: bool = True) -> dict:
    name = f"{model}-{memory}-{'offload' if offload else 'device'}-{precision}"
    flags = ["--model", model, "--sp", str(sp), "--memory", memory, "--precision", precision, "--device", device]
    if offload:
        flags += ["--offload", "--host-memory", HOST]
    row = {"case": name, "model": model, "memory": memory, "offload": offload, "precision": precision}
    rc, text, row["plan_s"] = run(["plan", *flags], os.path.join(out, f"{name}.plan.txt"))
    command = text.strip().splitlines()[-1].strip() if rc == 0 else ""
    if not command.startswith("autosp train "):
        row["error"] = f"plan exited {rc} without a train command"
        return row
    argv = shlex.split(command)[1:]
    at = argv.index("--seq-len") + 1
    row["length"] = length = int(argv[at])
    folder = os.path.join(out, name)
    subprocess.run(["rm", "-rf", folder])
    rc, text, row["train_s"] = run(argv + ["--steps", "3", "--out", folder, "--timeout", "600"],
                                   os.path.join(out, f"{name}.train.txt"))
    if rc != 0:
        row["error"] = f"train exited {rc}"
        return row
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    row["measured"] = max(m for r in rows for m in r["peak_mem_bytes"] if m is not None)
    # per rank and step: the first step of a fresh run is predicted without the moments its update makes
    row["predicted"] = max(p for r in rows for p in r["predicted_peak_bytes"])
    row["host"] = max(h for r in rows for h in r["host_bytes"])
    row["step_s"] = min(r["step_s"] for r in rows)
    row["limit"] = rows[0]["memory_bytes"]
    if not refuse:
        return row
    argv[at] = str(length + 64 * sp)
    refused = os.path.join(out, f"{name}-longer")
    rc, text, row["refuse_s"] = run(argv + ["--steps", "3", "--out", refused], os.path.join(out, f"{name}.longer.txt"))
    row["longer_exit"] = rc
    row["longer_names_L"] = f"--seq-len {length} (the longest length these flags fit" in text
    row["longer_wrote_nothing"] = not os.path.exists(refused)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | precision | memory per rank | offload | L (plan) | predicted peak | measured peak | "
             "measured - predicted | <= memory | one granule longer refused | host per rank | step | plan / train s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['precision']} | {r['memory']} | {'yes' if r['offload'] else 'no'} | "
                         f"{r.get('length', '-')} | error: {r['error']} |  |  |  |  |  |  |  |")
            continue
        off = (r["measured"] - r["predicted"]) / r["predicted"]
        refused = r.get("longer_exit") == 2 and r["longer_names_L"] and r["longer_wrote_nothing"]
        lines.append(f"| {r['model']} | {r['precision']} | {r['memory']} | {'yes' if r['offload'] else 'no'} | "
                     f"{r['length']:,} | {r['predicted']:,} B | {r['measured']:,} B | {100 * off:+.3f} % | "
                     f"{'yes' if r['measured'] <= r['limit'] else 'NO'} | "
                     f"{'yes (exit 2, names L)' if refused else 'not run' if 'longer_exit' not in r else 'NO (exit %d)' % r['longer_exit']} | "
                     f"{r['host'] / 2**20:.1f} MiB | {r['step_s']:.1f} s | {r['plan_s']:.0f} / {r['train_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    # planned afresh, not read from the plan cache: `autosp plan` and train's start are timed (the commands inherit it)
    os.environ["AUTOSP_PLAN_CACHE"] = "off"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--memory", action="append", default=[], help="MODEL=SIZE[,SIZE] (default: " +
                   "; ".join(f"{m}={','.join(s)}" for m, s in MEMORY.items()) + ")")
    p.add_argument("--offload", choices=["both", "yes", "no"], default="both")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-refuse", dest="refuse", action="store_false", help="skip step 3 (a CPU-only check)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "plan_vs_train"))
    a = p.parse_args()
    memory = dict(MEMORY)
    for spec in a.memory:
        model, sizes = spec.split("=")
        memory[model] = sizes.split(",")
    os.makedirs(a.out, exist_ok=True)
    offloads = {"both": [False, True], "yes": [True], "no": [False]}[a.offload]
    rows = []
    for model in a.models.split(","):
        for mem in memory[model]:
            for precision in a.precisions.split(","):
                for offload in offloads:
                    row = case(model, mem, offload, precision, a.out, a.sp, a.device, a.refuse)
                    rows.append(row)
                    with open(os.path.join(a.out, "results.jsonl"), "a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(json.dumps(row), flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()

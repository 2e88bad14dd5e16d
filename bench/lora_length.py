"""LoRA against full fine-tuning: the longest length each trains within the same memory per rank.

For a model, a memory size per rank and a mesh (default: the tiny preset at 32 MiB per rank, sp 2 on CPU):

  1. `autosp plan --memory M` without and with `--lora-r R` (one or more ranks R): the longest length L of each
     (the ILP row, held to train's own verdict), and the model state per rank;
  2. LoRA's `autosp train` command at its L runs 3 steps: each rank's measured peak (the profiler's allocation
     events, model state included) against its prediction, and against M.

    .venv/bin/python bench/lora_length.py                                   # tiny, 32MiB, sp 2, r 16 (a few minutes)
    .venv/bin/python bench/lora_length.py --ranks 4 16 --no-train
    .venv/bin/python bench/lora_length.py --model llama-3.1-8b --device cuda --precision bf16 --memory 80GiB \
        --sp 1 --no-train                                                   # planned only (about a minute each)

Prints a markdown table and writes each command's output under OUT (default bench/out/lora_length).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.plan_vs_train import run  # noqa: E402  (the same subprocess call and log)


def planned(text: str) -> tuple[int, str, str]:
    """(the ILP row's length, the model state line, the train command) of `autosp plan`'s answer (0 if none)."""
    row = re.search(r"^\| SP=\d+, ILP plan[^|]*\| ([\d,]+) \|", text, re.M) or \
        re.search(r"^\| SP=\d+, no remat \| ([\d,]+) \|", text, re.M)
    state = next((line for line in text.splitlines() if line.startswith("model state per rank")), "")
    command = next((line.strip() for line in text.splitlines() if line.strip().startswith("autosp train ")), "")
    return (int(row.group(1).replace(",", "")) if row else 0), state, command


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--memory", default="32MiB")
    p.add_argument("--sp", default="2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default=None)
    p.add_argument("--ranks", type=int, nargs="+", default=[16], help="LoRA ranks to plan (default 16)")
    p.add_argument("--no-train", dest="train", action="store_false", help="plan only")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "lora_length"))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    flags = ["--model", a.model, "--sp", a.sp, "--memory", a.memory, "--device", a.device]
    if a.precision:
        flags += ["--precision", a.precision]
    rows = []
    for r in [None, *a.ranks]:
        name = "full" if r is None else f"lora-r{r}"
        extra = [] if r is None else ["--lora-r", str(r)]
        rc, text, secs = run(["plan", *flags, *extra], os.path.join(a.out, f"{name}.plan.txt"))
        length, state, command = planned(text)
        row = {"case": name, "length": length, "plan_s": round(secs, 1), "state": state, "rc": rc}
        if r is not None and a.train and command:
            argv = shlex.split(command)[1:]
            folder = os.path.join(a.out, name)
            subprocess.run(["rm", "-rf", folder])
            rc, _, row["train_s"] = run(argv + ["--steps", "3", "--out", folder, "--timeout", "600"],
                                        os.path.join(a.out, f"{name}.train.txt"))
            metrics = os.path.join(folder, "metrics.jsonl")
            if rc == 0 and os.path.exists(metrics):
                found = [(m, q) for line in open(metrics) for m, q in zip(json.loads(line)["peak_mem_bytes"],
                                                                           json.loads(line)["predicted_peak_bytes"])
                         if m is not None]
                row["measured_max"] = max(m for m, _ in found)
                row["predicted_max"] = max(q for _, q in found)
                row["worst_off"] = max((m - q) / q for m, q in found)
            else:
                row["train_rc"] = rc
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{a.model}, --memory {a.memory} per rank, sp {a.sp}, {a.device}:\n")
    print("| run | longest length (autosp plan) | model state per rank | train at that length: measured max / "
          "predicted max (worst rank and step) |")
    print("|---|---|---|---|")
    for row in rows:
        state = re.sub(r"^model state per rank ", "", row["state"])[:160]
        trained = (f"{row['measured_max']:,} B / {row['predicted_max']:,} B ({100 * row['worst_off']:+.3f} %)"
                   if "measured_max" in row else "-" if "train_rc" not in row else f"exit {row['train_rc']}")
        print(f"| {row['case']} | {row['length']:,} | {state} | {trained} |")


if __name__ == "__main__":
    main()

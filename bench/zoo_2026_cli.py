"""`autosp train` on each of 2026's architectures from a config.json (tests/zoo.py's tiny configs, vocabulary 320
for the default corpus' bytes): planned within --memory, trained a few steps, each rank's measured peak against its
own prediction.

    .venv/bin/python bench/zoo_2026_cli.py --sp 2 --seq-len 256 --steps 2 --memory 16MiB [--names qwen3_5 mamba2]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def config_folder(name: str, root: str) -> str:
    import transformers
    from tests.zoo import HF_2026
    cfg_cls, model_cls, kw = HF_2026[name]
    kw = {k: v for k, v in kw.items() if k != "attn_implementation"}
    cfg = getattr(transformers, cfg_cls)(**{**kw, "vocab_size": 320})
    cfg.architectures = [model_cls]
    folder = os.path.join(root, name)
    cfg.save_pretrained(folder)
    return folder


def main():
    from tests.zoo import NAMES_2026
    ap = argparse.ArgumentParser()
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--memory", default="16MiB")
    ap.add_argument("--names", nargs="+", default=NAMES_2026)
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="zoo2026-")
    print(f"| model | exit | loss first -> last | measured peak against each rank's prediction | wall |")
    print("|---|---|---|---|---|")
    for name in a.names:
        folder = config_folder(name, root)
        cmd = [sys.executable, "-m", "autosp", "train", "--model", os.path.join(folder, "config.json"),
               "--sp", str(a.sp), "--seq-len", str(a.seq_len), "--steps", str(a.steps), "--memory", a.memory,
               "--out", os.path.join(root, name + "-run")]
        t = time.perf_counter()
        run = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t
        out = run.stdout + run.stderr
        loss = re.search(r"loss ([0-9.]+) -> ([0-9.]+)", out)
        peak = re.search(r"measured peak ([+-][0-9.]+ %)", out)
        err = next((line for line in out.splitlines() if "error" in line.lower()), "")
        print(f"| {name} | {run.returncode} | {'%s -> %s' % loss.groups() if loss else err[:120]} | "
              f"{peak.group(1) if peak else '-'} | {wall:.0f} s |", flush=True)


if __name__ == "__main__":
    main()

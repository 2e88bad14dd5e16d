"""`make demo`: `autosp train` with the tiny preset on 2 CPU ranks, on the Python standard library's
source as bytes, for a couple of minutes; it ends with the loss reached.

    python -m autosp.demo [--steps 200] [--out runs/demo]      # the same as:
    autosp train --model tiny --sp 2 --seq-len 512 --batch 4 --steps 200 --save-every 100 --out runs/demo

The run folder is the demo's own: an earlier demo there is replaced.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=os.path.join("runs", "demo"))
    a = ap.parse_args(argv)
    from autosp.run.checkpoint import checkpoints
    if os.path.isdir(a.out) and (checkpoints(a.out) or os.path.isfile(os.path.join(a.out, "metrics.jsonl"))):
        shutil.rmtree(a.out)                         # the demo's own folder from an earlier demo
    from autosp.cli import main as cli
    args = ["train", "--model", "tiny", "--sp", "2", "--seq-len", "512", "--batch", "4", "--steps", str(a.steps),
            "--save-every", "100", "--out", a.out]
    print("autosp " + " ".join(args), flush=True)
    return cli(args)


if __name__ == "__main__":
    sys.exit(main())

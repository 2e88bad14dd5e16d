"""The Trainer integration on the meshes beyond the suite's budget: dp 2 x sp 2 and sp 4, 4 gloo ranks on CPU.

    .venv/bin/python bench/trainer_meshes.py              # both meshes (about a minute and a half on 2 cores)
    .venv/bin/python bench/trainer_meshes.py --mesh 2x2

Each mesh runs, on every rank, tests/test_trainer.py's cases (3 steps of a tiny Llama at s = 45, a length neither
mesh's sp divides, 2 micro-batches per step, clipped): AutospTrainer (its losses, gradient norms, the parameters
after each step and the eval loss after training), AutospSFTTrainer, AutospDPOTrainer (with its eval loss and
metrics) and examples/keep_your_trainer.py, against the same trainers on one device with dp x the per-device batch.
Prints the worst relative error per case over the ranks (fp32: at most 1e-5) and the seconds the ranks took.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests import test_trainer as T  # noqa: E402
from tests.dist import run_ranks  # noqa: E402


def _job(rank, world, sp, assets):
    os.environ["OMP_NUM_THREADS"] = "1"          # else accelerate sets the torch threads of the rank
    from autosp.integrations.transformers import AutospDPOTrainer, AutospSFTTrainer, AutospTrainer
    batch = 2                                    # rows per dp group and micro-batch
    with tempfile.TemporaryDirectory() as d:
        trainer, losses, params = T._trainer_run(AutospTrainer, d, batch, sp=sp)
        dpo, dpo_eval = T._dpo_run(AutospDPOTrainer, d, assets["model"], batch, sp=sp)
        return {"trainer": losses, "trainer params": params, "trainer eval": [T._evaluated(trainer)],
                "sft": T._sft_run(AutospSFTTrainer, d, assets["model"], batch, sp=sp),
                "dpo": dpo, "dpo eval": dpo_eval,
                "example": T._example_run(assets, sp, d, batch)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", action="append", choices=["2x2", "1x4"], help="dp x sp (default: both)")
    a = p.parse_args()
    from transformers import Trainer
    from trl import DPOTrainer, SFTTrainer
    with tempfile.TemporaryDirectory() as d:
        assets = T.make_assets(d)
        for mesh in a.mesh or ["2x2", "1x4"]:
            dp, sp = (int(x) for x in mesh.split("x"))
            rows = 2 * dp                        # the one device takes every dp group's rows
            trainer, want, want_params = T._trainer_run(Trainer, os.path.join(d, "one"), rows)
            dpo, dpo_eval = T._dpo_run(DPOTrainer, os.path.join(d, "dpo"), assets["model"], rows)
            want = {"trainer": want, "trainer eval": [T._evaluated(trainer)],
                    "sft": T._sft_run(SFTTrainer, os.path.join(d, "sft"), assets["model"], rows),
                    "dpo": dpo, "dpo eval": dpo_eval,
                    "example": T._example_run(assets, 1, os.path.join(d, "ex"), rows)}
            t0 = time.perf_counter()
            got = run_ranks(_job, dp * sp, sp, assets, timeout=900)
            secs = time.perf_counter() - t0
            print(f"dp {dp} x sp {sp}, s = {T.S}: {secs:.0f} s for the ranks' four runs")
            for key in want:
                head = 1 if key.endswith("eval") else 2 * T.STEPS
                off = max(T._off(r[key], want[key], head=head) for r in got)
                what = "eval loss (and metrics)" if head == 1 else "losses and gradient norms"
                print(f"  {key:12s} {what}: worst relative error {off:.1e}")
            off = max(T._params_off(r["trainer params"], want_params) for r in got)
            print(f"  trainer  parameters after each step: worst relative error {off:.1e}")


if __name__ == "__main__":
    main()

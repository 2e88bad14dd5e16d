"""Where `autosp plan`'s time goes: each phase of `longest` timed, for one command line.

    .venv/bin/python bench/plan_time.py -- --model llama-3.1-8b --memory 80GiB --device cuda --precision bf16 \
        --offload --host-memory 1TiB --sp 8

Phases: the model's build and the tracer (before probing), the two probes (the short one prices the no-remat
programs, the long one searches the least-peak plan and replays it; run side by side in two processes), each of
train's verdicts the answer is checked with (autosp plan --seq-len L: a trace at L and the least-peak search), and
the ILP row priced again at the checked length when that differs. The plan cache is off (every phase plans); the
collector is set as `autosp plan` sets it; the import of autosp and the process's exit are not in the wall time.
Prints one line per phase, in the order they ended (each round of two verdicts with each one's excess over its
budget: where the next round is aimed from), then the answer and the wall time.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["AUTOSP_PLAN_CACHE"] = "off"


def main(argv=None) -> int:
    from autosp.run import answer, plan
    from autosp.run.config import add_step_flags, step_of
    argv = sys.argv[1:] if argv is None else argv
    argv = argv[1:] if argv[:1] == ["--"] else argv
    p = argparse.ArgumentParser()
    add_step_flags(p, "plan")
    step = step_of(p.parse_args(argv), "plan")
    t0 = time.perf_counter()
    log = []

    def timed(name, f):
        def run(*a, **k):
            t = time.perf_counter()
            out = f(*a, **k)
            what = a[0].seq_len if name == "verdict" else ""
            log.append((time.perf_counter() - t0, name, time.perf_counter() - t, what,
                        getattr(out, "fits", "")))
            return out
        return run

    answer.probe = timed("probe (both lengths, side by side)", plan.probe)
    both = plan._both

    def pair(first, second, parallel=True):             # a round of verdicts: each one's excess over the budget
        t = time.perf_counter()
        out = both(first, second, parallel)
        if all(isinstance(x, tuple) and isinstance(x[0], float) for x in out):
            log.append((time.perf_counter() - t0, "round of two verdicts", time.perf_counter() - t,
                        "excess " + ", ".join(f"{e / 2**20:+,.1f} MiB" + ("" if h is None else
                                                                         f" (host {h / 2**20:+,.1f} MiB)")
                                              for e, h, *_ in out), ""))
        return out
    plan._both = pair
    answer.at_length = timed("verdict", answer.at_length)
    with answer.full_collections_rarely():            # as `autosp plan` plans
        report = answer.longest(step)
    wall = time.perf_counter() - t0
    for end, name, secs, what, fits in log:
        print(f"{end:7.1f} s  {name} {what if what else ''}{'' if fits == '' else (' fits' if fits else ' refused')}: "
              f"{secs:.1f} s")
    print(str(report))
    print(f"answer {report.length:,}; wall {wall:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

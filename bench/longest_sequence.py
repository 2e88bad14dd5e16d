"""The longest sequence each method trains within a fixed per-rank memory, measured on CPU.

    .venv/bin/python bench/longest_sequence.py [--memory 64] [--layers 4] [--hidden 128] [--sp 2] [--steps 3]

Methods, on the same HF Llama (sdpa) and SP gloo ranks (1 thread each):
  ulysses        hand-written Ulysses: DeepSpeed's DistributedAttention (bench/sp_vs_ulysses.py), no checkpointing
  ulysses+ckpt   the same with per-layer full checkpointing (HF gradient checkpointing)
  autosp         autosp.value_and_grad with memory_budget = the memory (the ILP plan; a length the planner
                 refuses does not fit)
A length fits when the step's peak per rank -- bytes allocated above what was live before the step,
from the profiler's allocation events (autosp.memory.peak_bytes), the largest over the ranks -- is at
most --memory MiB. Per method the search brackets the answer (a fitting length, a failing one) and
probes where the line through the two nearest measured peaks meets the memory, else halfway, until
the bracket is one --granularity wide. Then the step times (forward + backward, median of --steps,
methods round-robin) of ulysses and autosp at ulysses' longest length, and of autosp at its own.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def search(fits, memory: int, g: int, start: int, cap: int, log, secant: bool = True):
    """The largest multiple of g with fits(s) = (True, peak); fits(s) returns (ok, peak or None).
    `secant`: peaks grow with s, so the line through two measured peaks says where to probe next
    (not so for autosp under a budget: its plan fills the budget at every length that fits; it doubles,
    then halves the bracket)."""
    lo = hi = None
    pts = []
    s = start
    while True:
        ok, peak = fits(s)
        log(f"    s={s}: {'fits' if ok else 'does not fit'}" + (f", peak {peak / 2**20:.2f} MiB" if peak else ""))
        if peak is not None:
            pts.append((s, peak))
        if ok:
            lo = s if lo is None else max(lo, s)
        else:
            hi = s if hi is None else min(hi, s)
        if lo is not None and hi is not None and hi - lo <= g:
            return lo
        if hi is None and s >= cap:
            return lo
        nxt = None
        near = sorted(pts, key=lambda p: abs(p[1] - memory))[:2]
        if secant and len(near) == 2 and near[0][0] != near[1][0]:
            (s1, m1), (s2, m2) = near
            slope = (m2 - m1) / (s2 - s1)
            if slope > 0:
                nxt = int((s1 + (memory - m1) / slope) // g) * g
        if nxt is None:
            nxt = (lo + hi) // 2 // g * g if lo is not None and hi is not None else (2 * s if ok else s // 2 // g * g)
        low = (lo + g) if lo is not None else g
        high = (hi - g) if hi is not None else cap
        if nxt in (s,) or not (low <= nxt <= high):
            nxt = min(max(nxt, low), high)
            if lo is not None and hi is not None and nxt in (lo, hi):
                nxt = (lo + hi) // 2 // g * g
        if lo is not None and nxt <= lo:
            nxt = lo + g
        s = nxt


def _job(rank, world, args):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autosp
    import deepspeed
    from autosp.memory import peak_bytes
    from bench.sp_vs_ulysses import register_ulysses_attention, ulysses_batch, ulysses_copy, ulysses_step
    from tests.models import batch, llama_loss, params_of, tiny_llama

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    sp = mesh.get_group("sp")
    torch.manual_seed(0)
    model = tiny_llama(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                       vocab=args.vocab)
    fn, params = llama_loss(model), params_of(model)
    live = {k: v.requires_grad_(True) for k, v in params.items()}
    register_ulysses_attention(sp)
    ds = {"ulysses": ulysses_copy(model), "ulysses+ckpt": ulysses_copy(model, checkpointing=True)}
    memory = int(args.memory * 2**20)
    say = print if rank == 0 else (lambda *a, **k: None)
    steps = {}

    def worst(x):
        out = [None] * world
        dist.all_gather_object(out, x)
        return max(out)

    def make(method, s):
        ids, labels = batch(1, s, args.vocab, seed=0)
        if method in ds:
            local = ulysses_batch(ids, labels, sp)
            m = ds[method]
            return lambda: ulysses_step(m, local, sp)
        f = autosp.value_and_grad(fn, mesh, memory_budget=memory)

        def step():
            loss, grads = f(live, ids, labels)
            return loss
        try:
            f(live, ids, labels)                      # compile and plan outside the measurement
        except autosp.AutospError as exc:
            if "smallest peak" not in str(exc):
                raise
            return None
        return step

    def free_grads():
        # before every measured or timed window: the previous step's grads are freed outside it on
        # every side (autosp's value_and_grad returns its grads, dropped when its step returns)
        for m in ds.values():
            m.zero_grad(set_to_none=True)

    def fits(method):
        def probe(s):
            step = make(method, s)
            refused = worst(step is None)
            if refused:
                return False, None
            free_grads()
            dist.barrier(sp)
            peak = worst(peak_bytes(step)[0])
            steps[(method, s)] = step
            return peak <= memory, peak
        return probe

    found = {}
    for method in ("ulysses", "ulysses+ckpt", "autosp"):
        t0 = time.perf_counter()
        say(f"  {method}:", flush=True)
        free_grads()
        make(method, args.granularity)()          # warm up the method's code paths once
        found[method] = search(fits(method), memory, args.granularity, args.start, args.cap,
                               lambda m: say(m, flush=True), secant=method != "autosp")
        say(f"  {method}: longest {found[method]} ({time.perf_counter() - t0:.0f} s)", flush=True)

    def timed(pairs):
        times = {p: [] for p in pairs}
        fns = {p: steps.get(p) or make(*p) for p in pairs}
        for p in pairs:
            free_grads()
            fns[p]()
        for _ in range(args.steps):
            for p in pairs:
                free_grads()
                dist.barrier(sp)
                t0 = time.perf_counter()
                fns[p]()
                dist.barrier(sp)
                times[p].append(time.perf_counter() - t0)
        return {p: statistics.median(t) for p, t in times.items()}

    short = found["ulysses"]
    times = timed([("ulysses", short), ("autosp", short), ("autosp", found["autosp"])])
    return found, {f"{m} @ {s}": t for (m, s), t in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory", type=float, default=64, help="per-rank step memory, MiB")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--granularity", type=int, default=512, help="global lengths are multiples of this")
    ap.add_argument("--start", type=int, default=2048)
    ap.add_argument("--cap", type=int, default=1 << 17)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    from tests.dist import run_ranks
    print("# " + " ".join([".venv/bin/python", "bench/longest_sequence.py"] + [shlex.quote(a) for a in
                                                                                 (argv or sys.argv[1:])]))
    print(f"# HF Llama layers={args.layers} hidden={args.hidden} heads={args.heads}/{args.kv_heads} "
          f"vocab={args.vocab}; SP={args.sp} gloo x 1 thread; {args.memory:g} MiB per rank; torch {torch.__version__}",
          flush=True)
    t0 = time.perf_counter()
    found, times = run_ranks(_job, args.sp, args, timeout=7200)[0]
    u = found["ulysses"]
    print("\n| method | longest global sequence | vs ulysses |\n|---|---|---|")
    for m, s in found.items():
        print(f"| {m} | {s:,} | {s / u:.2f}x |")
    print("\n| step (fwd+bwd) | median (s) |\n|---|---|")
    for k, t in times.items():
        print(f"| {k} | {t:.3f} |")
    ratio = times[f"autosp @ {u}"] / times[f"ulysses @ {u}"]
    print(f"\nautosp / ulysses: {found['autosp'] / u:.2f}x the length (target >= 2.7x); step time at {u:,}: "
          f"{ratio:.3f}x (target <= 1.1x); total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

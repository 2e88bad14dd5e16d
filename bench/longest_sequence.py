"""The longest sequence each method trains within a fixed per-rank memory, measured on CPU.

    .venv/bin/python bench/longest_sequence.py [--memory 64] [--layers 4] [--hidden 128] [--sp 2] [--steps 3]
        [--methods ulysses,ulysses+ckpt,alst,autosp] [--alst-loss-slice MiB] [--check-len 1024]

Methods (--methods, default all), on the same HF Llama (sdpa) and SP gloo ranks (1 thread each):
  ulysses        hand-written Ulysses: DeepSpeed's DistributedAttention (bench/sp_vs_ulysses.py), no checkpointing
  ulysses+ckpt   the same with per-layer full checkpointing (HF gradient checkpointing)
  alst           ALST's recipe as DeepSpeed 0.19 ships it (bench/alst.py): ulysses+ckpt, plus DeepSpeed's
                 TiledMLP around every decoder layer's MLP and TiledFusedLogitsLoss for lm head + loss;
                 tiles as ALST picks them: MLP ceil(local s / hidden), loss ceil(fp32 local logits /
                 slice), the slice ArcticTraining's 1 GiB on 80 GiB GPUs scaled to --memory (memory / 80)
                 unless --alst-loss-slice; before the search, its loss and grads at --check-len are held
                 to the single-device eager run (relative 1e-5, or the run stops)
  autosp         autosp.value_and_grad with memory_budget = the memory (the ILP plan; a length the planner
                 refuses does not fit)
A length fits when the step's peak per rank -- bytes allocated above what was live before the step,
from the profiler's allocation events (autosp.memory.peak_bytes), the largest over the ranks -- is at
most --memory MiB; each method's peak is measured on its second step at that length (autosp's first
compiles and plans; the others' first sets up caches and buffers, which made ALST's first-step peaks
vary by 20 % between runs). Per method the search brackets the answer (a fitting length, a failing one) and
probes where the line through the two nearest measured peaks meets the memory, else halfway, until
the bracket is one --granularity wide. Then the step times (forward + backward, median of --steps,
all timed steps round-robin, so each pair alternates A/B): autosp against ulysses at ulysses' longest
length, autosp against alst at alst's longest, and autosp at its own longest.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import command  # noqa: E402

METHODS = ("ulysses", "ulysses+ckpt", "alst", "autosp")
RTOL = 1e-5            # fp32 loss and grads against the single device, as the tests hold autosp


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
    from bench.alst import alst_copy, alst_step, check_alst, loss_tiles, mlp_tiles
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
    builders = {"ulysses": ulysses_copy, "ulysses+ckpt": lambda m: ulysses_copy(m, checkpointing=True),
                "alst": alst_copy}
    ds = {m: builders[m](model) for m in args.methods if m in builders}
    memory = int(args.memory * 2**20)
    slice_bytes = args.alst_loss_slice * 2**20
    say = print if rank == 0 else (lambda *a, **k: None)
    steps = {}

    def worst(x):
        out = [None] * world
        dist.all_gather_object(out, x)
        return max(out)

    def make(method, s):
        ids, labels = batch(1, s, args.vocab, seed=0)
        if method == "alst":
            local = ulysses_batch(ids, labels, sp)
            say(f"    s={s}: alst tiles: MLP {mlp_tiles(s // world, args.hidden)}, "
                f"loss {loss_tiles(s // world, args.vocab, slice_bytes)}", flush=True)
            return lambda: alst_step(ds["alst"], local, sp, slice_bytes)
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
            if method != "autosp":                # autosp's make() ran one step: every method is measured
                step()                            # on its second step at a length, not on one-time setup
            free_grads()
            dist.barrier(sp)
            peak = worst(peak_bytes(step)[0])
            steps[(method, s)] = step
            return peak <= memory, peak
        return probe

    if "alst" in ds:
        errs, tiles = check_alst(ds["alst"], sp, args.check_len, slice_bytes, fn, params, args.vocab)
        worst_err = worst(max(errs.values()))
        say(f"  alst vs single-device eager at s={args.check_len} (tiles: MLP {tiles['mlp']}, loss "
            f"{tiles['loss']}): loss and {len(errs) - 1} grads, max relative error {worst_err:.2e} "
            f"over ranks ({'ok' if worst_err <= RTOL else 'FAILED'}, tolerance {RTOL:g})", flush=True)
        if not worst_err <= RTOL:
            bad = sorted(errs.items(), key=lambda kv: -kv[1])[:5]
            raise AssertionError(f"alst differs from the single device at s={args.check_len} (rank {rank}): "
                                 + ", ".join(f"{k} {e:.2e}" for k, e in bad))

    found = {}
    for method in args.methods:
        t0 = time.perf_counter()
        say(f"  {method}:", flush=True)
        free_grads()
        make(method, args.granularity)()          # warm up the method's code paths once
        found[method] = search(fits(method), memory, args.granularity, args.start, args.cap,
                               lambda m: say(m, flush=True), secant=method != "autosp")
        say(f"  {method}: longest {found[method]} ({time.perf_counter() - t0:.0f} s)", flush=True)

    def timed(pairs):
        fns = {p: steps.get(p) or make(*p) for p in pairs}
        refused = [p for p in pairs if worst(fns[p] is None)]       # autosp's plan refuses that length
        for p in refused:
            say(f"  {p[0]} @ {p[1]}: refused (does not fit), not timed", flush=True)
        pairs = [p for p in pairs if p not in refused]
        times = {p: [] for p in pairs}
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

    # each baseline against autosp at the baseline's longest length, then autosp at its own
    pairs = []
    for base in ("ulysses", "alst"):
        if base in found and found[base]:
            pairs += [(base, found[base])] + ([("autosp", found[base])] if "autosp" in found else [])
    if found.get("autosp"):
        pairs.append(("autosp", found["autosp"]))
    pairs = list(dict.fromkeys(pairs))
    if not pairs:              # neither ulysses, alst nor autosp: each method at its own longest
        pairs = [(m, s) for m, s in found.items() if s]
    times = timed(pairs)
    return found, {f"{m} @ {s}": t for (m, s), t in times.items()}


def main(argv=None):
    # planned afresh, not read from the plan cache: each search is timed, autosp's first step plans
    os.environ["AUTOSP_PLAN_CACHE"] = "off"
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
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of " + ", ".join(METHODS))
    ap.add_argument("--alst-loss-slice", type=float, default=None,
                    help="alst: MiB of fp32 logits per loss tile (default memory / 80, ALST's 1 GiB on 80 GiB)")
    ap.add_argument("--check-len", type=int, default=1024, help="alst's check against the single device")
    args = ap.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or not args.methods:
        ap.error(f"--methods: unknown {unknown}; pick from {', '.join(METHODS)}")
    if args.alst_loss_slice is None:
        from bench.alst import SLICE_PER_MEMORY
        args.alst_loss_slice = args.memory * SLICE_PER_MEMORY
    from tests.dist import run_ranks
    print("# " + command(__file__, argv))
    print(f"# HF Llama layers={args.layers} hidden={args.hidden} heads={args.heads}/{args.kv_heads} "
          f"vocab={args.vocab}; SP={args.sp} gloo x 1 thread; {args.memory:g} MiB per rank; torch {torch.__version__}",
          flush=True)
    print(f"# methods: {', '.join(args.methods)}" + (
        f"; alst tiles: MLP ceil(local s / {args.hidden}), loss ceil(local s x {args.vocab} x 4 B / "
        f"{args.alst_loss_slice:g} MiB)" if "alst" in args.methods else ""), flush=True)
    t0 = time.perf_counter()
    found, times = run_ranks(_job, args.sp, args, timeout=7200)[0]
    bases = [b for b in ("ulysses", "alst") if found.get(b)]
    print("\n| method | longest global sequence |" + "".join(f" vs {b} |" for b in bases)
          + "\n|---|---|" + "---|" * len(bases))
    for m, s in found.items():
        print(f"| {m} | {s or 0:,} |" + "".join(f" {(s or 0) / found[b]:.2f}x |" for b in bases))
    print("\n| step (fwd+bwd) | median (s) |\n|---|---|")
    for k, t in times.items():
        print(f"| {k} | {t:.3f} |")
    print()
    for base, target in (("ulysses", 2.7), ("alst", 1.5)):
        b = found.get(base)
        if not b or "autosp" not in found:
            continue
        at = times.get(f"autosp @ {b}")
        step = f"{at / times[f'{base} @ {b}']:.3f}x (target <= 1.1x)" if at is not None else "autosp refuses it"
        print(f"autosp / {base}: {found['autosp'] / b:.2f}x the length (target >= {target}x); "
              f"step time at {b:,}: {step}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

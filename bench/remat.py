"""The remat frontier: (measured peak per rank, recompute FLOPs, step time) for each way of trading
memory for recomputation, on the same sharded Llama-style model, SP gloo ranks on CPU.

    .venv/bin/python bench/remat.py [--seq 1024 4096 16384] [--layers 4] [--hidden 128] [--steps 3]

Per sequence length (per rank; the global length is sp times it):
  none      autosp, memory_budget=None (what autograd saves)
  autosp    autosp's ILP plan at budgets 1.0 ... down to the least it reaches
  torch     the same sharded graph (autosp's per-rank forward) through functorch's aot_module:
            default_partition, then min_cut_rematerialization_partition with torch's
            activation_memory_budget swept; the all-to-all is priced for the partitioner at the
            FLOPs its transfer time would buy, so it sees what recomputing a collective costs
  ulysses   hand-written Ulysses (DeepSpeed's DistributedAttention), without and with per-layer full
            checkpointing (HF gradient checkpointing: torch.utils.checkpoint), if deepspeed imports
Peaks: the profiler's allocation events (autosp.memory.peak_bytes), one step, on top of the
parameters and the batch; every method's previous grads are freed before the window opens.
Recompute FLOPs, counted alike for every method: torch's FlopCounterMode around one executed
forward + backward, minus the same count for the no-remat step of the same program: `none` for
autosp and torch (autograd running that per-rank program saves what the backward reads; torch's
default_partition is no such baseline: its backward runs attention's forward again), plain Ulysses
for the checkpointed one. Collectives count 0 everywhere (DeepSpeed's c10d all-to-all has no
formula, so autosp's all-to-all is not priced here either).
Step times: median of --steps, the methods run round-robin (A/B/C/...) on the same ranks.
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

AUTOSP_BUDGETS = (1.0, 0.8, 0.6, 0.5, 0.4)
TORCH_BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)


def _step_flops(step) -> int:
    """FLOPs of one executed step, by torch's counter; a collective counts 0 (see the docstring)."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False, custom_mapping={torch.ops.autosp.all_to_all: _no_flops}) as fc:
        step()
    return fc.get_total_flops()


def _no_flops(*args, **kwargs) -> int:
    return 0


def _register_collective_flops():
    """The partitioner ranks recomputation by FLOPs: a collective costs the FLOPs its transfer would buy."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    from autosp.remat.cost import DEVICES
    cpu = DEVICES["cpu"]
    packet = torch.ops.autosp.all_to_all
    if packet in flop_registry:
        return

    @register_flop_formula(packet)
    def _a2a(xs, *args, out_shape=None, **kwargs) -> int:
        elems = sum(int(torch.Size(s).numel()) for s in xs)
        return int(elems * 4 / cpu.link_bw * cpu.flops)


def _job(rank, world, args, seq):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autosp
    from autosp.api import Sharded, _differentiable
    from autosp.ir.lower import lower
    from autosp.memory import peak_bytes
    from autosp.remat import joint_of
    from tests.models import batch, llama_loss, params_of, tiny_llama

    torch.set_num_threads(1)
    _register_collective_flops()          # before torch's partitioner first runs
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    sp = mesh.get_group("sp")
    torch.manual_seed(0)
    model = tiny_llama(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                       vocab=args.vocab)
    fn, params = llama_loss(model), params_of(model)
    ids, labels = batch(1, seq * world, args.vocab, pad=5)
    live = _differentiable(params)
    flat = list(live.values()) + [ids, labels]
    methods = {}                     # name -> (step, name of the same program's no-remat step)
    owners = [live.values()]         # every method's parameters: clear() frees their grads

    def clear():
        for ps in owners:
            for p in ps:
                p.grad = None

    def as_step(f):
        def step():
            loss = f()
            loss.backward()
            return loss.detach()
        return step

    # ---- autosp: no remat, and the ILP at each budget
    none = autosp.shard(fn, mesh)
    methods["none"] = (as_step(lambda: none(live, ids, labels)), "none")
    _, local = Sharded(fn, mesh).graphs(live, ids, labels)
    boundary, _ = joint_of(local)
    for b in args.budgets:
        step = autosp.shard(fn, mesh, memory_budget=b)
        try:
            step.plan(live, ids, labels)
        except autosp.AutospError as exc:
            if "smallest peak" not in str(exc):
                raise
            continue
        methods[f"autosp {b}"] = (as_step(lambda step=step: step(live, ids, labels)), "none")
    try:                                   # the least the planner reaches, read from its refusal of 1 byte
        autosp.plan(fn, mesh, params, ids, labels, memory_budget=1)
    except autosp.AutospError as exc:
        least = int(str(exc).split("Fix: memory_budget=")[1].split()[0])
        step = autosp.shard(fn, mesh, memory_budget=least)
        plan = step.plan(live, ids, labels)
        methods[f"autosp least ({least / plan.no_remat_peak_bytes:.3f})"] = (
            as_step(lambda step=step: step(live, ids, labels)), "none")

    # ---- torch: the same per-rank graph through aot_module: the default partition, then min-cut with
    # activation_memory_budget swept
    import torch._functorch.config as fconfig
    from functorch.compile import aot_module, default_partition, min_cut_rematerialization_partition
    from torch._dynamo.backends.debugging import boxed_nop
    gm = lower(boundary.graph)
    scale = boundary.scale[0]
    for name, partition, b in [("torch default", default_partition, 1.0)] + [
            (f"torch {b}", min_cut_rematerialization_partition, b) for b in args.torch_budgets]:
        with fconfig.patch(activation_memory_budget=b):
            compiled = aot_module(gm, fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition)
            out = compiled(*flat)           # partitions now, under this budget
            out[0].backward()
        clear()

        def torch_step(compiled=compiled):
            loss = compiled(*flat)[0]
            loss.backward(torch.full_like(loss, scale))
            for p in live.values():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=sp)
            return loss.detach()
        methods[name] = (torch_step, "none")

    # ---- hand-written Ulysses with per-layer checkpointing (torch.utils.checkpoint)
    if args.ds:
        try:
            import deepspeed  # noqa: F401 - the side needs it
            methods.update(_ds_methods(model, ids, labels, sp, owners))
        except ImportError:
            pass

    # ---- measure: peaks and FLOPs one by one, then round-robin step times; grads freed before each window
    rows = {}
    for name, (step, _) in methods.items():
        clear()
        step()                                             # warm up (compiles)
        clear()
        peak, loss = peak_bytes(step)
        clear()
        rows[name] = {"peak": peak, "step_flops": _step_flops(step), "loss": float(loss), "times": []}
    for name, (_, base) in methods.items():
        rows[name]["flops"] = rows[name]["step_flops"] - rows[base]["step_flops"]
    for _ in range(args.steps):
        for name, (step, _) in methods.items():
            clear()
            dist.barrier(sp)
            t0 = time.perf_counter()
            step()
            dist.barrier(sp)
            rows[name]["times"].append(time.perf_counter() - t0)
    return rows


def _ds_methods(model, ids, labels, sp, owners):
    from bench.sp_vs_ulysses import register_ulysses_attention, ulysses_batch, ulysses_copy, ulysses_step
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    register_ulysses_attention(sp)
    local_batch = ulysses_batch(ids, labels, sp)
    out = {}
    for name, ckpt in (("ulysses (DS)", False), ("ulysses (DS) + per-layer ckpt", True)):
        m = ulysses_copy(model, checkpointing=ckpt)
        owners.append(list(m.parameters()))
        out[name] = (lambda m=m: ulysses_step(m, local_batch, sp), "ulysses (DS)")
    return out


def frontier_check(rows, seq, hidden):
    """autosp never worse than torch's frontier; where s >= 4 hidden, <= 2/3 of torch's peak at equal FLOPs."""
    auto = [(r["peak"], r["flops"]) for n, r in rows.items() if n.startswith("autosp")]
    lines = []
    for n, r in rows.items():
        if not n.startswith("torch"):
            continue
        ok = [p for p, f in auto if f <= r["flops"] * 1.001 + 1]
        best = min(ok) if ok else None
        ratio = best / r["peak"] if best else float("nan")
        lines.append(f"| {n} | {r['peak'] / 2**20:.2f} | {r['flops']:.3g} | "
                     f"{best / 2**20 if best else float('nan'):.2f} | {ratio:.3f} |")
    return lines


def main(argv=None):
    # planned afresh, not read from the plan cache: autosp's first step plans
    os.environ["AUTOSP_PLAN_CACHE"] = "off"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384], help="per-rank lengths")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budgets", type=float, nargs="+", default=list(AUTOSP_BUDGETS))
    ap.add_argument("--torch-budgets", type=float, nargs="+", default=list(TORCH_BUDGETS))
    ap.add_argument("--no-ds", dest="ds", action="store_false", help="skip the DeepSpeed checkpointing side")
    args = ap.parse_args(argv)
    from tests.dist import run_ranks
    cmd = command(__file__, argv)
    print(f"# {cmd}\n# HF Llama layers={args.layers} hidden={args.hidden} heads={args.heads}/{args.kv_heads} "
          f"vocab={args.vocab}; SP={args.sp} gloo x 1 thread; torch {torch.__version__}", flush=True)
    for seq in args.seq:
        t0 = time.perf_counter()
        res = run_ranks(_job, args.sp, args, seq, timeout=7200)
        rows = res[0]
        print(f"\n## s = {seq} per rank ({seq * args.sp} global), {time.perf_counter() - t0:.0f} s\n")
        print("| method | peak/rank (MiB) | max peak over ranks (MiB) | step FLOPs | recompute FLOPs | max over ranks | "
              "median step (s) | loss |")
        print("|---|---|---|---|---|---|---|---|")
        for name, r in rows.items():
            worst = max(rr[name]["peak"] for rr in res)
            most = max(rr[name]["flops"] for rr in res)
            print(f"| {name} | {r['peak'] / 2**20:.2f} | {worst / 2**20:.2f} | {r['step_flops']:.4g} | "
                  f"{r['flops']:.3g} | {most:.3g} | "
                  f"{statistics.median(r['times']):.3f} | {r['loss']:.6f} |")
        print("\n| torch point | its peak (MiB) | its recompute FLOPs | autosp's best peak at <= those FLOPs | ratio |")
        print("|---|---|---|---|---|")
        for line in frontier_check(rows, seq, args.hidden):
            print(line)
        sys.stdout.flush()


if __name__ == "__main__":
    main()

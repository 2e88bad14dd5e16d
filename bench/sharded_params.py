"""Model state sharded (autosp.shard_params) vs replicated, one training step at a time on CPU (gloo).

Same HF Llama, same batch, SP = 2 processes (1 thread each); a step is value_and_grad + AdamW:
  A = parameters as DTensors, Shard(0) over the ranks: gathered in the step, gradients reduce-scattered,
      AdamW on the local shards
  B = parameters replicated (today's default): gradients all-reduced, AdamW on whole tensors
Steps alternate A, B, A, B; the first step of each compiles and is compared (loss, gathered grads).
Reported: median step time per side and A/B, each rank's model state bytes (parameters + gradients +
AdamW moments) and the step's peak (autosp.memory.peak_bytes: the profiler's allocation events).

    .venv/bin/python bench/sharded_params.py [--seq 4096 --steps 5 --layers 4 --hidden 256]
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


def _job(rank, world, args):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    import autosp
    from autosp.memory import peak_bytes
    from tests.models import batch, llama_loss

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                      max_position_embeddings=max(4096, args.seq), attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    fn = llama_loss(model)
    ids, labels = batch(1, args.seq, args.vocab, seed=0)
    whole = {k: v.detach().clone() for k, v in model.named_parameters()}
    sides = {}
    for side, params in (("A", autosp.shard_params(whole, mesh)), ("B", {k: v.clone() for k, v in whole.items()})):
        params = {k: v.requires_grad_(True) for k, v in params.items()}
        sides[side] = (params, torch.optim.AdamW(list(params.values()), lr=1e-4),
                       autosp.value_and_grad(fn, mesh, memory_budget=args.memory_budget))

    def step(side):
        params, opt, vg = sides[side]
        loss, grads = vg(params, ids, labels)
        for k, p in params.items():
            p.grad = grads[k]
        opt.step()
        return loss, grads

    def free(side):
        for p in sides[side][0].values():
            p.grad = None

    first = {}
    for side in ("A", "B"):
        t0 = time.perf_counter()
        first[side] = step(side)
        first[side] = (first[side], time.perf_counter() - t0)
        free(side)
    (loss_a, grads_a), first_a = first["A"]
    (loss_b, grads_b), first_b = first["B"]
    grad_rel = max(((grads_a[k].full_tensor() - grads_b[k]).abs().max() / grads_b[k].abs().max()).item()
                   for k in grads_b)
    del grads_a, grads_b, first

    times = {"A": [], "B": []}
    for _ in range(args.steps):
        for side in ("A", "B"):
            free(side)
            dist.barrier()
            t0 = time.perf_counter()
            step(side)
            dist.barrier()
            times[side].append(time.perf_counter() - t0)

    def state_bytes(side):
        params, opt, _ = sides[side]
        local = lambda t: (t.to_local() if hasattr(t, "to_local") else t)   # noqa: E731
        total = 0
        for p in params.values():
            total += local(p).numel() * p.element_size() * 2                 # the parameter and its gradient
            total += sum(local(v).numel() * v.element_size() for v in opt.state[p].values() if v.ndim)
        return total

    def peak(side):
        free(side)
        dist.barrier()
        return peak_bytes(lambda: step(side) and None)[0]

    state = {s: state_bytes(s) for s in ("A", "B")}
    mem = {"A": peak("A"), "B": peak("B")}
    return {"loss_a": float(loss_a), "loss_b": float(loss_b), "grad_rel": grad_rel, "first_a": first_a,
            "first_b": first_b, "times": times, "state": state, "mem": mem}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per side (after 1 compiling step each)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--memory-budget", type=float, default=None)
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    from tests.dist import run_ranks
    cmd = command(__file__, argv)
    print(f"# {cmd}")
    print(f"# HF Llama: layers={args.layers} hidden={args.hidden} heads={args.heads} vocab={args.vocab}; seq={args.seq}; "
          f"SP={args.sp} gloo procs x 1 thread; AdamW; torch {torch.__version__}", flush=True)
    res = run_ranks(_job, args.sp, args, timeout=args.timeout)
    r0 = res[0]
    print(f"\nfirst step (incl. trace+compile): A {r0['first_a']:.2f}s, B {r0['first_b']:.2f}s")
    print(f"loss A (sharded) = {r0['loss_a']:.8f}  B (replicated) = {r0['loss_b']:.8f}  "
          f"rel diff {abs(r0['loss_a'] - r0['loss_b']) / abs(r0['loss_b']):.2e}; "
          f"grads max rel diff {max(r['grad_rel'] for r in res):.2e}")
    med = {s: statistics.median(r0["times"][s]) for s in ("A", "B")}
    print("\n| metric | sharded (A) | replicated (B) | A/B |")
    print("|---|---|---|---|")
    print(f"| median step time, value_and_grad + AdamW ({args.steps} steps, s) | {med['A']:.3f} | {med['B']:.3f} | "
          f"{med['A'] / med['B']:.3f} |")
    for rank, r in enumerate(res):
        print(f"| rank {rank} model state (params + grads + moments) | {r['state']['A'] / 2**20:.2f} MiB | "
              f"{r['state']['B'] / 2**20:.2f} MiB | {r['state']['A'] / r['state']['B']:.3f} |")
        print(f"| rank {rank} step peak above live | {r['mem']['A'] / 2**20:.2f} MiB | {r['mem']['B'] / 2**20:.2f} MiB | "
              f"{r['mem']['A'] / r['mem']['B']:.3f} |")
    print("\nA/B per step (alternating):", " ".join(f"{a / b:.3f}" for a, b in zip(r0["times"]["A"], r0["times"]["B"])))


if __name__ == "__main__":
    main()

"""Ulysses x ring at sp=4 on CPU (gloo): the same training step with U=4 (all-to-all only), U=2 x R=2 and
U=1 x R=4 (a ring over all ranks), alternating U4, U2R2, R4, U4, ... one step at a time.

Same HF Llama, same batch, 4 processes (1 thread each); a step is value_and_grad (forward + backward).
Reported: losses (equal to each other), median step time per configuration and its ratio to U=4.

    .venv/bin/python bench/ulysses_ring.py [--seq 4096 --steps 3 --layers 4 --hidden 256]
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

CONFIGS = (("U=4", 1), ("U=2 x R=2", 2), ("R=4", 4))


def _job(rank, world, args):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    import autosp
    from tests.models import batch, llama_loss

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads // 2, max_position_embeddings=max(4096, args.seq),
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    fn = llama_loss(model)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ids, labels = batch(1, args.seq, args.vocab, seed=0)
    steps = {name: autosp.value_and_grad(fn, mesh, ring=ring) for name, ring in CONFIGS}
    losses = {name: float(step(params, ids, labels)[0]) for name, step in steps.items()}   # compiles
    times = {name: [] for name, _ in CONFIGS}
    for _ in range(args.steps):
        for name, step in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(params, ids, labels)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    return {"losses": losses, "times": times}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args(argv)
    from tests.dist import run_ranks
    cmd = command(__file__, argv)
    print(f"# {cmd}")
    print(f"# HF Llama: layers={args.layers} hidden={args.hidden} heads={args.heads}/{args.heads // 2} "
          f"vocab={args.vocab}; seq={args.seq}; sp=4 gloo procs x 1 thread; torch {torch.__version__}", flush=True)
    res = run_ranks(_job, 4, args, timeout=args.timeout)
    r0 = res[0]
    print("\nlosses: " + ", ".join(f"{k} {v:.8f}" for k, v in r0["losses"].items()))
    med = {k: statistics.median(v) for k, v in r0["times"].items()}
    base = med[CONFIGS[0][0]]
    print("\n| configuration at sp=4 | median step (fwd+bwd), s | vs U=4 |")
    print("|---|---|---|")
    for name, _ in CONFIGS:
        print(f"| {name} | {med[name]:.3f} | {med[name] / base:.3f} |")
    print("\nper step: " + "; ".join(f"{k}: " + " ".join(f"{t:.2f}" for t in v) for k, v in r0["times"].items()))


if __name__ == "__main__":
    main()

"""A DPO step against two SFT steps of the same lengths, on CPU (gloo), SP = 2 processes (1 thread each).

Same HF Llama (sdpa), steps alternating A/B/A/B:
  A = one DPO step: autosp.value_and_grad(dpo_loss, mesh, has_aux=True) on 1 pair = 2 sequences of --seq tokens
      (the chosen and the rejected, answers on the last quarter), reference log-probabilities given
  B = two SFT steps: autosp.value_and_grad(step_loss, mesh) on 1 sequence of --seq tokens, twice
Median step time per side, and the per-rank peak of one A and of one B's SFT step (bytes allocated above what was
live before it: autosp.memory.peak_bytes, the profiler's allocation events) beside the plan's predictions.

    .venv/bin/python bench/dpo_step.py [--seq 2048 --steps 5 --layers 4 --hidden 256]
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


def job(rank, world, args):
    import autosp
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    from autosp.memory import peak_bytes
    from autosp.run.dpo import dpo_loss
    from autosp.run.plan import step_loss
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max(4096, args.seq), attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    params = {k: v.detach().requires_grad_(True) for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (2, args.seq), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, -args.seq // 4:] = ids[:, -args.seq // 4:]
    ref = torch.tensor([-900.0, -905.0])
    dpo = autosp.value_and_grad(dpo_loss(model, 0.1), mesh, memory_budget=1.0, has_aux=True)
    sft = autosp.value_and_grad(lambda p, i, lab: step_loss(model, p, i, lab), mesh, memory_budget=1.0)

    def a():
        dpo(params, ids, labels, ref)

    def b():
        sft(params, ids[:1], ids[:1])
        sft(params, ids[1:], ids[1:])
    a(), b()                                             # compiled outside the timing
    times = {"A": [], "B": []}
    for _ in range(args.steps):
        for name, fn in (("A", a), ("B", b)):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    peak_a, _ = peak_bytes(a)
    peak_b, _ = peak_bytes(lambda: sft(params, ids[:1], ids[:1]))
    plan_a = dpo.plan(params, ids, labels, ref).peak_bytes
    plan_b = sft.plan(params, ids[:1], ids[:1]).peak_bytes
    return {k: statistics.median(v) for k, v in times.items()}, (peak_a, plan_a), (peak_b, plan_b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    args = p.parse_args()
    from tests.dist import run_ranks
    out = run_ranks(job, 2, args, timeout=3600, fresh=True)
    print(command(__file__))
    print(f"Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; {args.seq} tokens per sequence; "
          f"SP 2 on CPU (gloo, 1 thread per rank); medians of {args.steps} A/B rounds")
    for rank, (t, (pa, qa), (pb, qb)) in enumerate(out):
        print(f"rank {rank}: DPO step (1 pair, 2 sequences) {t['A'] * 1e3:.0f} ms, two SFT steps {t['B'] * 1e3:.0f} ms "
              f"(A/B {t['A'] / t['B']:.3f}); peak DPO {pa / 2**20:.2f} MiB (planned {qa / 2**20:.2f}), one SFT step "
              f"{pb / 2**20:.2f} MiB (planned {qb / 2**20:.2f}), ratio {pa / pb:.3f}")


if __name__ == "__main__":
    main()

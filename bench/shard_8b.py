"""Shard an 8B-shaped Llama (meta device, no memory) for SP ranks and report the compile time.

    .venv/bin/python bench/shard_8b.py [--layers 32] [--seq 32768] [--sp 2]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.dist import run_ranks  # noqa: E402


def _job(rank, world, layers, seq):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    import autosp
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                      attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    params = dict(model.named_parameters())
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))

    def loss_fn(params, input_ids, labels):
        return torch.func.functional_call(model, params, (input_ids,), {"labels": labels}).loss

    step = autosp.shard(loss_fn, mesh)
    t0 = time.perf_counter()
    graph, local = step.graphs(params, ids, ids)
    dt = time.perf_counter() - t0
    colls = {}
    for e in local.eqns:
        if e.op.name in ("all_to_all", "all_reduce_sum", "all_gather_seq", "shard_slice"):
            colls[e.op.name] = colls.get(e.op.name, 0) + 1
    return len(graph.eqns), len(local.eqns), dt, colls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--sp", type=int, default=2)
    a = ap.parse_args()
    n, m, dt, colls = run_ranks(_job, a.sp, a.layers, a.seq)[0]
    print(f"{a.layers} layers, seq {a.seq}, sp={a.sp}: trace + shard in {dt:.1f} s; "
          f"{n} global -> {m} per-rank equations; collectives {colls}")


if __name__ == "__main__":
    main()

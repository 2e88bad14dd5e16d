"""Trace an 8B-shaped Llama (32 layers, hidden 4096, 32/8 heads, seq 32768) on the meta device.

Reports the trace time and the resident-memory growth. Usage:
    .venv/bin/python bench/trace_8b.py [--layers 32] [--seq 32768]
"""
import argparse
import resource
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autosp


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=32768)
    a = ap.parse_args()
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=a.layers,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                      attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    params = dict(model.named_parameters())
    ids = torch.zeros(1, a.seq, dtype=torch.long, device="meta")

    def loss_fn(params, input_ids, labels):
        return torch.func.functional_call(model, params, (input_ids,), {"labels": labels}).loss

    for name, fn in [("forward", loss_fn)]:
        base = rss_mb()
        t0 = time.perf_counter()
        graph = autosp.trace(fn, params, ids, ids)
        dt = time.perf_counter() - t0
        print(f"{name}: {a.layers} layers, seq {a.seq}: {len(graph.eqns)} equations, "
              f"trace {dt:.1f} s, resident growth {rss_mb() - base:.0f} MB")


if __name__ == "__main__":
    main()

"""`make demo`: 2 CPU ranks train a small Llama-style model on 4096-token sequences with autosp.

Prints per-step loss, checks the first loss against the single-device run, and reports per-rank
peak memory (MemTracker) against the single-device step.
"""
from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.multiprocessing as mp


def build(seq: int, layers: int, hidden: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    # a learnable stream: a short repeating motif with noise, so the loss visibly falls
    motif = torch.randint(0, vocab, (61,), generator=g)
    ids = motif.repeat(seq // 61 + 1)[:seq].clone()
    noise = torch.rand(seq, generator=g) < 0.1
    ids[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
    ids = ids[None]
    labels = ids.clone()
    labels[:, :64] = -100                      # an untrained prompt

    def loss_fn(params, input_ids, labels):
        return torch.func.functional_call(model, params, (input_ids,), {"labels": labels}).loss

    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return loss_fn, params, ids, labels


def _peak(step, tensors):
    from autosp.memory import peak_bytes
    return peak_bytes(step, *tensors)


def worker(rank: int, world: int, port: int, a) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autosp
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    loss_fn, params, ids, labels = build(a.seq, a.layers, a.hidden, a.vocab)
    live = {k: v.requires_grad_(True) for k, v in params.items()}
    say = print if rank == 0 else (lambda *x, **k: None)

    single_peak = single_loss = None
    if rank == 0:
        def single():
            loss = loss_fn(live, ids, labels)
            loss.backward()
            return loss.detach()
        single_peak, single_loss = _peak(single, list(live.values()) + [ids, labels])
        for v in live.values():
            v.grad = None

    step = autosp.shard(loss_fn, mesh)
    t0 = time.perf_counter()
    step(live, ids, labels)                    # trace + shard + lower, once per signature
    say(f"autosp: compiled for sp={world}, sequence {a.seq} in {time.perf_counter() - t0:.1f} s")

    def one_step():
        loss = step(live, ids, labels)
        loss.backward()
        return loss.detach()

    opt = torch.optim.AdamW(list(live.values()), lr=a.lr)
    losses, peak = [], None
    bar = range(a.steps)
    if rank == 0:
        from tqdm import tqdm
        bar = tqdm(bar, desc="train", unit="step")
    for i in bar:
        opt.zero_grad(set_to_none=True)
        if i == 0:
            peak, loss = _peak(one_step, list(live.values()) + [ids, labels])
        else:
            loss = one_step()
        opt.step()
        losses.append(loss.item())
        if rank == 0:
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        for i, l in enumerate(losses):
            print(f"step {i}: loss {l:.6f}")
        diff = abs(losses[0] - single_loss.item())
        ok = diff <= 1e-5 * abs(single_loss.item())
        print(f"first loss: autosp {losses[0]:.6f}, single device {single_loss.item():.6f}, "
              f"|diff| {diff:.2e} -> {'OK' if ok else 'MISMATCH'}")
        for r, p in enumerate(peaks):
            print(f"rank {r} peak memory {p / 2**20:.1f} MiB = {p / single_peak:.2f}x single-device "
                  f"({single_peak / 2**20:.1f} MiB)")
        if not ok:
            raise SystemExit(1)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(a.sp, port, a), nprocs=a.sp, join=True)


if __name__ == "__main__":
    main()

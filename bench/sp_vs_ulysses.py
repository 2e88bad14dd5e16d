"""autosp vs a hand-written DeepSpeed-Ulysses on CPU (gloo), one training step at a time.

Same HF Llama (sdpa), same global batch, SP = 2 processes (1 thread each), steps alternating A/B:
  A = autosp.shard(loss_fn, mesh)(params, ids, labels).backward()    -- single-device loss code
  B = hand-written Ulysses: deepspeed.sequence.layer.DistributedAttention around SDPA (is_causal),
      registered as a transformers attention function; ids sharded by hand, position ids offset,
      labels shifted globally then sharded, local summed loss / global token count, param grads
      all-reduced over sp.
First step: both losses (and grads) compared. Then median step time (fwd+bwd) per side and per-rank
peak memory of one step: bytes allocated above what was live before it (autosp.memory.peak_bytes,
the profiler's allocation events). Both sides free the previous step's grads before a timed or
measured window opens, so neither window contains the other step's frees.

    .venv/bin/python bench/sp_vs_ulysses.py [--seq 4096 --steps 5 --layers 4 --hidden 256]
    .venv/bin/python bench/sp_vs_ulysses.py --compile [--compile-ulysses]   # A through inductor [B torch.compile'd]
    .venv/bin/python bench/sp_vs_ulysses.py --compile --blocking   # and C: A with its collectives blocking
    .venv/bin/python bench/sp_vs_ulysses.py --compile --eager      # and D: autosp eager (compiled A against it)
    .venv/bin/python bench/sp_vs_ulysses.py --profile              # and where each side's step time goes
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

ATTN_NAME = "ds_ulysses_sdpa"
IGNORE = -100


def build_model(args, attn_implementation, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=max(4096, args.seq),
                      attn_implementation=attn_implementation, **extra)
    # With use_cache=False (--no-cache, autosp's side only) HF's sdpa path builds an explicit
    # [b, 1, s, s] causal mask and repeats K/V; autosp evaluates the mask once, sees that it is
    # causal and runs is_causal attention. The Ulysses side always runs plain causal SDPA.
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def register_ulysses_attention(group):
    """A transformers attention function: DistributedAttention (all-to-all seq<->heads) around SDPA."""
    from deepspeed.sequence.layer import DistributedAttention
    from transformers import AttentionInterface

    def local_attn(q, k, v, scale=None, enable_gqa=False):
        # [b, s_global, h/p, d] -> SDPA layout [b, h/p, s, d]; causal over the full sequence
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)

    dist_attn = DistributedAttention(local_attn, group, scatter_idx=2, gather_idx=1)

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # HF hands [b, h, s/p, d]; DistributedAttention with batch_dim_idx=0 wants [b, s/p, h, d]
        # and returns [b, s/p, h, d], which is what HF expects back from an attention function.
        assert attention_mask is None, "the Ulysses attention assumes plain causal attention (no padding mask)"
        gqa = getattr(module, "num_key_value_groups", 1) > 1
        out = dist_attn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), 0,
                        None, scale=scaling, enable_gqa=gqa)
        return out.contiguous(), None

    AttentionInterface.register(ATTN_NAME, attention)


def ulysses_copy(model, checkpointing: bool = False):
    """`model` (an HF Llama) rebuilt on the Ulysses attention function, same weights, in train mode;
    with per-layer activation checkpointing when asked (call register_ulysses_attention first)."""
    from transformers import LlamaForCausalLM
    cfg = model.config.__class__(**{**model.config.to_dict(), "attn_implementation": ATTN_NAME})
    m = LlamaForCausalLM(cfg)
    m.load_state_dict(model.state_dict())
    if checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return m.train()


def ulysses_batch(ids, labels, group):
    """This rank's share of the batch, by hand: sharded ids, offset positions, labels shifted
    globally then sharded, and the global count of counted tokens."""
    import torch.distributed as dist
    r, p = dist.get_rank(group), dist.get_world_size(group)
    s = ids.size(1)
    assert s % p == 0, "the hand-written side needs seq divisible by sp"
    lo, hi = r * (s // p), (r + 1) * (s // p)
    ids_loc = ids[:, lo:hi].contiguous()                                    # shard the ids
    pos_loc = torch.arange(lo, hi).unsqueeze(0).expand(ids.size(0), -1)     # offset positions
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)  # shift globally
    lab_loc = shifted[:, lo:hi].contiguous()                                # ... then shard
    n_tok = (lab_loc != IGNORE).sum().to(torch.float32)
    dist.all_reduce(n_tok, group=group)                                     # global token count
    return ids_loc, pos_loc, lab_loc, n_tok


def ulysses_step(model, local_batch, group):
    """One fwd+bwd of the hand-written side: local summed loss / global token count, grads summed
    over sp by hand. Returns the global loss. The caller frees the previous step's grads first
    (`model.zero_grad(set_to_none=True)`), outside any measured window: freed inside it, they
    would lower this side's peak against a side that has nothing to free."""
    import torch.nn.functional as F
    ids_loc, pos_loc, lab_loc, n_tok = local_batch
    logits = model(input_ids=ids_loc, position_ids=pos_loc).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), lab_loc.flatten(),
                           ignore_index=IGNORE, reduction="sum") / n_tok
    loss.backward()
    return reduce_over_sp(model, loss, group)


def reduce_over_sp(model, loss, group):
    """After a rank's backward: its parameter gradients and loss summed over the sp group (each rank's
    loss is its share of the global mean, so the sums are the global gradients and loss)."""
    import torch.distributed as dist
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return total


def _job(rank, world, args):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autosp
    from autosp.memory import peak_bytes
    import deepspeed
    from tests.models import batch, llama_loss

    deepspeed.init_distributed(dist_backend="gloo")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    sp = mesh.get_group("sp")

    ids, labels = batch(args.batch, args.seq, args.vocab, seed=0)           # global, identical on all ranks

    # ---- A: autosp on the plain single-device loss
    model_a = build_model(args, "sdpa", **({"use_cache": False} if args.no_cache else {}))
    params = {k: v.detach().clone().requires_grad_(True) for k, v in model_a.named_parameters()}
    step_a_fn = autosp.shard(llama_loss(model_a), mesh, memory_budget=args.memory_budget, compile=args.compile)

    def step_a():
        loss = step_a_fn(params, ids, labels)
        loss.backward()
        return loss.detach(), {k: p.grad for k, p in params.items()}

    # ---- C (--blocking): A with every collective blocking where it stands (passes/schedule.py off)
    params_c = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    step_c_fn = autosp.shard(llama_loss(model_a), mesh, memory_budget=args.memory_budget, compile=args.compile)

    def step_c():
        os.environ["AUTOSP_OVERLAP"] = "0"          # read when the step is planned, at its first call
        try:
            loss = step_c_fn(params_c, ids, labels)
        finally:
            os.environ.pop("AUTOSP_OVERLAP", None)
        loss.backward()
        return loss.detach(), {k: p.grad for k, p in params_c.items()}

    # ---- D (--eager): autosp as A, not compiled (A's compile against it)
    params_d = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    step_d_fn = autosp.shard(llama_loss(model_a), mesh, memory_budget=args.memory_budget)

    def step_d():
        loss = step_d_fn(params_d, ids, labels)
        loss.backward()
        return loss.detach(), {k: p.grad for k, p in params_d.items()}

    # ---- B: hand-written Ulysses on DeepSpeed's DistributedAttention
    register_ulysses_attention(sp)
    model_b = build_model(args, ATTN_NAME)
    model_b.load_state_dict(model_a.state_dict())
    local_batch = ulysses_batch(ids, labels, sp)
    run_b = torch.compile(model_b) if args.compile_ulysses else model_b     # its parameters are model_b's

    def step_b():
        total = ulysses_step(run_b, local_batch, sp)
        return total, {k: p.grad for k, p in model_b.named_parameters()}

    def free_grads():
        for p in (*params.values(), *params_c.values(), *params_d.values()):
            p.grad = None
        model_b.zero_grad(set_to_none=True)

    # ---- first step: agreement (also warms up / compiles autosp)
    free_grads()
    t0 = time.perf_counter()
    loss_a, grads_a = step_a()
    first_a = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss_b, grads_b = step_b()
    first_b = time.perf_counter() - t0
    grad_rel = max(((grads_a[k] - grads_b[k]).abs().max() / grads_b[k].abs().max().clamp_min(1e-12)).item()
                   for k in grads_b)
    del grads_a, grads_b
    sides = ("A", "B") + (("C",) if args.blocking else ()) + (("D",) if args.eager else ())
    same_c = None
    if args.eager:
        free_grads()
        step_d()
    if args.blocking:
        free_grads()
        loss_c, grads_c = step_c()
        free_grads()
        loss_a2, grads_a2 = step_a()
        same_c = bool(torch.equal(loss_c, loss_a2) and all(torch.equal(grads_c[k], grads_a2[k]) for k in grads_c))
        del grads_c, grads_a2

    # ---- timing: alternate A, B, A, B ...
    times = {side: [] for side in sides}
    fns = {"A": step_a, "B": step_b, "C": step_c, "D": step_d}
    for _ in range(args.steps):
        for side in sides:
            free_grads()
            dist.barrier(sp)
            t0 = time.perf_counter()
            out = fns[side]()
            dist.barrier(sp)
            times[side].append(time.perf_counter() - t0)
            del out

    # ---- peak memory of one step per side: bytes allocated on top of what was live before it
    # (activations, temporaries, collective buffers, grads), from the profiler's allocation events
    def peak(side):
        free_grads()
        dist.barrier(sp)
        return peak_bytes(lambda: fns[side]() and None)[0]

    mem = {"A": peak("A"), "B": peak("B")}
    profiles = {side: profile_step(fns[side], free_grads, sp) for side in sides} if args.profile else None

    return {"rank": rank, "loss_a": loss_a.item(), "loss_b": loss_b.item(), "grad_rel": grad_rel,
            "first_a": first_a, "first_b": first_b, "times": times, "mem": mem, "same_c": same_c,
            "profiles": profiles}


# the kernels both sides run on the same shapes: what no lowering of the rest of the step can make cheaper
SHARED = ("aten::_scaled_dot_product_flash_attention_for_cpu_backward",
          "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::mm")


def profile_step(step, free_grads, group):
    """{op name: self CPU seconds} of one step under torch.profiler, and the step's seconds."""
    import torch.distributed as dist
    from autosp.memory import _quiet_stderr
    free_grads()
    dist.barrier(group)
    with _quiet_stderr():
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    with _quiet_stderr():
        prof.__exit__(None, None, None)
    return {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}, seconds


def print_profiles(profiles, top=8):
    """Per side: the step's seconds under the profiler, the kernels both sides share, and the largest others."""
    print("\n| side | profiled step (s) | " + " | ".join(n.replace("aten::_scaled_dot_product_", "sdpa ")
                                                    for n in SHARED) + " | shared total | the rest |")
    print("|---|---|" + "---|" * (len(SHARED) + 2))
    for side, (ops, seconds) in profiles.items():
        shared = [ops.get(n, 0.0) for n in SHARED]
        print(f"| {side} | {seconds:.3f} | " + " | ".join(f"{t:.3f}" for t in shared)
              + f" | {sum(shared):.3f} ({sum(shared) / seconds:.0%}) | {seconds - sum(shared):.3f} |")
    for side, (ops, _) in profiles.items():
        rest = sorted(((t, n) for n, t in ops.items() if n not in SHARED), reverse=True)[:top]
        print(f"{side}, the largest others (self CPU s): " + ", ".join(f"{n} {t:.3f}" for t, n in rest))
    if "A" in profiles and "B" in profiles:
        (_, b), shared_a = profiles["B"], sum(profiles["A"][0].get(n, 0.0) for n in SHARED)
        print(f"A's shared kernels alone are {shared_a / b:.3f} of B's profiled step: A/B cannot go below that "
              "without faster attention or matmuls")


def main(argv=None):
    # planned afresh, not read from the plan cache: autosp's first step is timed, planning included
    os.environ["AUTOSP_PLAN_CACHE"] = "off"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per side (after 1 warm-up each)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=None, help="default 2 * hidden")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--no-cache", action="store_true", help="autosp's model with use_cache=False (explicit mask)")
    ap.add_argument("--memory-budget", type=float, default=None, help="autosp's memory_budget (fraction)")
    ap.add_argument("--compile", action="store_true", help="autosp's programs through inductor (compile=True)")
    ap.add_argument("--compile-ulysses", action="store_true", help="the hand-written side under torch.compile")
    ap.add_argument("--blocking", action="store_true",
                    help="also C: A with every collective blocking where it stands (AUTOSP_OVERLAP=0), in the rotation")
    ap.add_argument("--eager", action="store_true",
                    help="also D: autosp as A without compile=True, in the rotation (with --compile: A's gain)")
    ap.add_argument("--profile", action="store_true",
                    help="also one profiled step per side (rank 0): the kernels both run against the rest")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    if args.intermediate is None:
        args.intermediate = 2 * args.hidden

    from tests.dist import run_ranks
    cmd = command(__file__, argv)
    print(f"# {cmd}")
    print(f"# HF Llama: layers={args.layers} hidden={args.hidden} inter={args.intermediate} heads={args.heads} "
          f"kv_heads={args.kv_heads} vocab={args.vocab}; batch={args.batch} seq={args.seq}; SP={args.sp} "
          f"gloo procs x 1 thread; torch {torch.__version__}", flush=True)
    t0 = time.perf_counter()
    res = run_ranks(_job, args.sp, args, timeout=args.timeout)
    wall = time.perf_counter() - t0

    r0 = res[0]
    print(f"\nfirst step (incl. autosp trace+compile): A {r0['first_a']:.2f}s, B {r0['first_b']:.2f}s")
    print(f"loss  A (autosp) = {r0['loss_a']:.8f}   B (Ulysses) = {r0['loss_b']:.8f}   "
          f"|diff| = {abs(r0['loss_a'] - r0['loss_b']):.3e}   "
          f"(rel {abs(r0['loss_a'] - r0['loss_b']) / abs(r0['loss_b']):.2e})")
    print(f"grads max rel diff A vs B (max over params, ranks): {max(r['grad_rel'] for r in res):.3e}")

    med = {s: statistics.median(r0["times"][s]) for s in ("A", "B")}
    print("\n| metric | autosp (A) | DS-Ulysses (B) | A/B |")
    print("|---|---|---|---|")
    print(f"| median step time, fwd+bwd ({args.steps} steps, s) | {med['A']:.3f} | {med['B']:.3f} | "
          f"{med['A'] / med['B']:.3f} |")
    if args.blocking:
        med["C"] = statistics.median(r0["times"]["C"])
        print(f"| median step time, autosp with blocking collectives (C, s) | {med['C']:.3f} | | A/C "
              f"{med['A'] / med['C']:.3f} |")
    if args.eager:
        med["D"] = statistics.median(r0["times"]["D"])
        print(f"| median step time, autosp eager (D, s) | {med['D']:.3f} | | A/D "
              f"{med['A'] / med['D']:.3f} |")
    for r in res:
        ma, mb = r["mem"]["A"] / 2**20, r["mem"]["B"] / 2**20
        print(f"| peak memory rank {r['rank']} (MiB, step allocations) | {ma:.1f} | {mb:.1f} | {ma / mb:.3f} |")
    print(f"\nstep times A: {', '.join(f'{t:.5f}' for t in r0['times']['A'])}")
    print(f"step times B: {', '.join(f'{t:.5f}' for t in r0['times']['B'])}")
    if args.blocking:
        print(f"step times C: {', '.join(f'{t:.5f}' for t in r0['times']['C'])}")
        print(f"C equals A bit for bit (loss and grads, every rank): {all(r['same_c'] for r in res)}")
    if args.eager:
        print(f"step times D: {', '.join(f'{t:.5f}' for t in r0['times']['D'])}")
    if args.profile:
        print_profiles(r0["profiles"])
    print(f"total wall {wall:.0f}s")


if __name__ == "__main__":
    main()

"""The training loop one rank runs (started by torch.distributed.run, ours or the user's).

Every rank builds the same model from the seed and, with more than one rank, shards its state
(`autosp.shard_params`: every parameter a DTensor split on dim 0 over all dp x sp ranks, FSDP2's
layout; `--no-shard-params` keeps it whole on every rank). Each rank reads its dp part of the step's
global batch and takes `autosp.value_and_grad(loss_fn, mesh, memory_budget=...)`: the loss, and the
gradients laid out as the parameters (this rank's shard, or the whole gradient). AdamW, warmup +
cosine, gradient clipping on those gradients; sharded, each rank updates its own rows, replicated,
every rank takes the same update. `--optimizer-offload` steps AdamW on fp32 host copies instead
(optim.OffloadedAdamW). Rank 0 shows the progress bar and writes DIR/metrics.jsonl and
DIR/loss.png; all ranks write the checkpoints. Nothing is written before the first step has
compiled and run, so a model or a memory budget autosp refuses leaves no trace.
"""
from __future__ import annotations

import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from autosp.run import checkpoint, faults, metrics
from autosp.run.data import batch_for_step, check_corpus, open_corpus
from autosp.run.models import build_model, count_parameters, describe, model_config
from autosp.run.optim import make_optimizer, make_schedule, state_bytes


def _say(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def _mesh(device: str, dp: int, sp: int):
    from torch.distributed.device_mesh import init_device_mesh
    if dp == 1:
        return init_device_mesh(device, (sp,), mesh_dim_names=("sp",))
    return init_device_mesh(device, (dp, sp), mesh_dim_names=("dp", "sp"))


def _bar(start: int, total: int):
    if dist.get_rank() != 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, desc="train")


def _state_line(model, world: int, dev: torch.device, sharded: bool, offload: bool) -> str:
    """The banner's line on model state: where it lives and how many bytes each rank holds."""
    on_dev, on_host = state_bytes(model, offload=offload)
    how = (f"sharded over {world} ranks (Shard(0), FSDP2's layout)" if sharded else
           "replicated on every rank (--no-shard-params)" if world > 1 else "whole (one rank)")
    if not offload:
        return f"model state: {how}; {on_dev / 2**20:.2f} MiB per rank (parameters + gradients + AdamW moments)"
    return (f"model state: {how}; {on_dev / 2**20:.2f} MiB per rank on {dev.type} (parameters + gradients), "
            f"{on_host / 2**20:.2f} MiB in host memory (--optimizer-offload: fp32 master weights, gradients and "
            "AdamW moments)")


def worker(a) -> None:
    """One rank of `autosp train`; `a` is the parsed command line (cli.py)."""
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if a.device == "cuda":
        torch.cuda.set_device(local_rank)
    dev = torch.device(a.device, local_rank) if a.device == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", timeout=timedelta(seconds=a.timeout))
    try:
        faults.maybe_fail("step", 0)             # before the heavy imports: a cheap drill for tests
        from autosp.api import value_and_grad
        _train(a, world, dev, value_and_grad)
    except BaseException as exc:
        from autosp.run.launch import record_failure
        record_failure(exc)                      # now: tearing the group down after a peer failed may abort
        raise
    finally:
        dist.destroy_process_group()


def _train(a, world: int, dev: torch.device, value_and_grad) -> None:
    rank = dist.get_rank()
    sp = a.sp
    dp = world // sp
    mesh = _mesh(dev.type, dp, sp)
    dp_rank = rank // sp                         # the mesh is (dp, sp), row-major over global ranks

    spec = model_config(a.model)
    corpus = open_corpus(a.data, a.dtype)
    check_corpus(corpus, a.seq_len, spec.vocab)
    model = build_model(spec, seed=a.seed, device=str(dev))
    model.train()
    sharded = world > 1 and a.shard_params
    if sharded:
        from autosp.params import shard_params
        shard_params(model, mesh)
    opt = make_optimizer(model, lr=a.lr, weight_decay=a.weight_decay, offload=a.optimizer_offload)
    warmup = a.warmup if a.warmup is not None else max(1, min(100, a.steps // 10))
    sched = make_schedule(opt, warmup=warmup, total=a.steps, floor=a.min_lr_ratio)
    state = {"step": 0, "scheduler": sched.state_dict(), "seed": a.seed, "seq_len": a.seq_len, "batch": a.batch}

    start = 0
    resumed = checkpoint.latest(a.out) if a.resume else None
    if resumed is not None:
        state = checkpoint.load(resumed, model, opt, state)
        sched.load_state_dict(state["scheduler"])
        start = int(state["step"])
        for key in ("seed", "seq_len", "batch"):
            if state.get(key) != getattr(a, key):
                _say(f"note: the checkpoint was trained with --{key.replace('_', '-')} {state.get(key)}, "
                     f"this run uses {getattr(a, key)}: the data order changes from here on")
    if a.resume and resumed is None:
        _say(f"note: --resume, but {a.out} holds no complete checkpoint yet: starting at step 0")
    if start >= a.steps:
        _say(f"{resumed} is at step {start}, which already reaches --steps {a.steps}. Pass a larger --steps "
             "to train further.")
        return

    params = dict(model.named_parameters())

    def loss_fn(params, input_ids, labels):
        return torch.func.functional_call(model, params, (input_ids,), {"labels": labels}).loss

    step_fn = value_and_grad(loss_fn, mesh, memory_budget=a.memory_budget)
    tokens_per_step = a.batch * a.seq_len
    n_params = count_parameters(model)
    _say(f"autosp train: {describe(spec)}, {n_params / 1e6:.2f}M parameters\n"
         f"  ranks {world} = dp {dp} x sp {sp} on {dev.type} ({'nccl' if dev.type == 'cuda' else 'gloo'}); "
         f"global batch {a.batch} x {a.seq_len} tokens; {a.steps} steps, lr {a.lr} (warmup {warmup}, cosine)\n"
         f"  data: {corpus.name}, {corpus.length:,} tokens = {corpus.sequences(a.seq_len):,} sequences\n"
         f"  memory budget: {a.memory_budget if a.memory_budget is not None else 'none (autograd saves all)'}\n"
         f"  {_state_line(model, world, dev, sharded, a.optimizer_offload)}"
         + (f"\n  resumed from {resumed} (step {start})" if resumed else ""))

    writer = bar = None
    mem_kind = metrics.MEMORY_KIND.get(dev.type, "peak")
    first_loss = last_loss = None
    run_losses: list[float] = []
    t_start = time.perf_counter()
    for n in range(start + 1, a.steps + 1):
        faults.maybe_fail("step", n)
        t0 = time.perf_counter()
        rows = batch_for_step(corpus, seq_len=a.seq_len, batch=a.batch, step=n - 1, seed=a.seed, part=(dp_rank, dp))
        ids = torch.from_numpy(rows).to(dev)
        loss, grads = step_fn(params, ids, ids)
        for name, p in params.items():
            p.grad = grads[name]
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), a.clip) if a.clip > 0 else None
        if norm is not None and hasattr(norm, "full_tensor"):  # sharded gradients: a replicated DTensor
            norm = norm.full_tensor()
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_v = float(loss)
        dt = time.perf_counter() - t0
        mem = torch.tensor([metrics.peak_memory_bytes(dev)], dtype=torch.float64, device=dev)
        mems = [torch.zeros_like(mem) for _ in range(world)]
        dist.all_gather(mems, mem)
        if rank == 0:
            if writer is None:                   # the first step compiled and ran: now the run may write
                os.makedirs(a.out, exist_ok=True)
                mpath = os.path.join(a.out, "metrics.jsonl")
                metrics.truncate(mpath, start)
                writer = metrics.Writer(mpath)
                bar = _bar(start, a.steps)
            row = {"step": n, "loss": loss_v, "lr": lr, "grad_norm": None if norm is None else float(norm),
                   "tokens": n * tokens_per_step, "step_s": dt, "tokens_per_s": tokens_per_step / dt,
                   "peak_mem_bytes": [int(m.item()) for m in mems], "peak_mem_kind": mem_kind}
            writer.write(row)
            if bar is not None:
                bar.set_postfix_str(f"loss {loss_v:.4f} | {tokens_per_step / dt:,.0f} tok/s | {mem_kind} "
                                    + " ".join(f"r{i} {m.item() / 2**20:.0f}M" for i, m in enumerate(mems)))
                bar.update(1)
            elif n % max(1, a.steps // 20) == 0 or n == a.steps:
                print(f"step {n}/{a.steps}  loss {loss_v:.4f}  {tokens_per_step / dt:,.0f} tok/s", flush=True)
        first_loss = loss_v if first_loss is None else first_loss
        last_loss = loss_v
        run_losses.append(loss_v)
        if (a.save_every and n % a.save_every == 0) or n == a.steps:
            state = {**state, "step": n, "scheduler": sched.state_dict()}
            saved = checkpoint.save(a.out, n, model, opt, state)
            if bar is not None:
                bar.set_description(f"train (saved {os.path.basename(saved)})")
    wall = time.perf_counter() - t_start
    if rank == 0:
        if bar is not None:
            bar.close()
        writer.close()
        png = metrics.plot_loss(os.path.join(a.out, "metrics.jsonl"), os.path.join(a.out, "loss.png"),
                                f"autosp train --model {a.model}: dp {dp} x sp {sp}, {a.batch} x {a.seq_len} "
                                "tokens per step")
        k = min(10, len(run_losses))
        mean = f" (mean of the last {k} steps {sum(run_losses[-k:]) / k:.4f})" if k > 1 else ""
        plot = (f"loss curve {png}" if png else
                "loss curve skipped: matplotlib is not installed (pip install 'autosp[train]')")
        print(f"trained steps {start + 1}-{a.steps} in {wall:.0f} s: loss {first_loss:.4f} -> {last_loss:.4f}{mean}; "
              f"a uniform guess over the {spec.vocab} tokens scores ln {spec.vocab} = {math.log(spec.vocab):.3f}\n"
              f"  checkpoint {os.path.join(a.out, f'step-{a.steps}')}\n"
              f"  metrics    {os.path.join(a.out, 'metrics.jsonl')}\n"
              f"  {plot}", flush=True)

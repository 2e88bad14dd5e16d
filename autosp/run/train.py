"""The training loop one rank runs (started by torch.distributed.run, ours or the user's).

Every rank builds the same model from the seed and, with more than one rank (or in bf16), shards its
state (`autosp.shard_params`: every parameter a DTensor split on dim 0 over all dp x sp ranks, FSDP2's
layout and mixed precision; `--no-shard-params` keeps it whole on every rank). Each rank reads its dp
part of the step's global batch and takes `autosp.value_and_grad(loss_fn, mesh, memory_budget=...)`
under the plan `autosp plan --seq-len` makes for the same flags (answer.Fit: the budget --memory leaves
the step, the host capacity, the tiling, the ring): the loss, and the gradients laid out as the
parameters (this rank's shard, or the whole gradient). AdamW, warmup + cosine, gradient clipping on
those gradients; sharded, each rank updates its own rows, replicated, every rank takes the same update.
`--optimizer-offload` steps AdamW on fp32 host copies instead (optim.OffloadedAdamW).

Each step's peak of allocated device memory is measured (autosp.memory.StepMeter) and written beside
the plan's prediction. Rank 0 shows the progress bar and writes DIR/metrics.jsonl and DIR/loss.png;
all ranks write the checkpoints. Nothing is written before the first step has compiled and run, so a
model or a memory budget autosp refuses leaves no trace.
"""
from __future__ import annotations

import json
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from autosp.run import checkpoint, faults, metrics, token_mean
from autosp.run.data import batch_inputs
from autosp.run.models import build_model, count_parameters, describe, spec_of
from autosp.run.optim import make_optimizer, make_schedule, state_bytes
from autosp.run.token_mean import accumulated_step, token_mean_loss, with_divisor


def _whole_line(corpus, seq_len: int) -> str:
    """Chat data: that each sequence holds whole conversations, and how many were longer than one."""
    if not getattr(corpus, "whole_documents", False):       # text; DPO's pairs (PairData) are whole already
        return ""
    from autosp.run.data import bins
    _, _, cut = bins(corpus, seq_len)
    n = len(corpus.documents)
    return (f" of whole conversations ({n:,}, padded to {seq_len:,} tokens"
            + (f"; {cut:,} longer than that, each its last {seq_len:,} tokens" if cut else "") + ")")


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


def _state_line(model, world: int, dev: torch.device, sharded: bool, offload: bool, moments: int) -> str:
    """The banner's line on model state: where it lives and how many bytes each rank holds."""
    on_dev, on_host = state_bytes(model, offload=offload, moments=moments)
    how = (f"sharded over {world} ranks (Shard(0), FSDP2's layout)" if sharded and world > 1 else
           "fp32 master weights (FSDP2's mixed precision on one rank)" if sharded else
           "replicated on every rank (--no-shard-params)" if world > 1 else "whole (one rank)")
    opt = "AdamW moments" if moments else "no optimizer state"
    if not offload:
        return f"model state: {how}; {on_dev / 2**20:.2f} MiB per rank (parameters + gradients + {opt})"
    return (f"model state: {how}; {on_dev / 2**20:.2f} MiB per rank on {dev.type} (parameters + gradients), "
            f"{on_host / 2**20:.2f} MiB in host memory (--optimizer-offload: fp32 master weights, gradients and "
            "AdamW moments)")


def _memory_lines(fit, plan, step) -> str:
    """The banner's lines on memory: the plan this rank runs, its predicted peak and host bytes."""
    from autosp.run.plan import fmt
    p = plan
    how = ("no remat" if p.peak_bytes >= p.no_remat_peak_bytes else
           f"{sum(d.action == 'recompute' for d in p.decisions)} values recomputed"
           + (f", {fmt(p.offload_bytes)} offloaded" if p.offload_bytes else ""))
    if p.tiling:
        from autosp.run.answer import _tiled_names
        how += ", tiles " + ", ".join(_tiled_names(p.tiling))
    within = f" within --memory {step.memory}" if step.memory is not None else ""
    if p.stored:
        within += " (from the plan cache: AUTOSP_PLAN_CACHE=0 plans again)"
    return (f"  memory plan{within}: budget {fmt(p.budget_bytes) if p.budget_bytes else 'none'} for the step ({how})\n"
            f"  predicted peak per rank: {fmt(fit.resident + p.const_bytes + p.peak_bytes)} of allocated {step.device} "
            f"memory = model state {fmt(fit.state.resident)} + token ids {fmt(fit.tokens)}"
            + (f" + the program's constants {fmt(p.const_bytes)}" if p.const_bytes else "")
            + f" + the step's {fmt(p.peak_bytes)}; "
            f"host: {fmt(fit.state.host + p.offload_bytes)} per rank"
            + (f" (activations {fmt(p.offload_bytes)} of this rank's {fmt(fit.host_cap)})" if step.offload else ""))


def worker(a) -> None:
    """One rank of `autosp train`; `a` is the parsed command line (cli.py), `a.step` its Step."""
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = a.step.device
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    dev = torch.device(device, local_rank) if device == "cuda" else torch.device("cpu")
    # on a GPU the group is bound to the rank's device: NCCL starts at once, and barriers run there
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(seconds=a.timeout),
                            **({"device_id": dev} if device == "cuda" else {}))
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


MEASURED_STEPS = 3          # CPU: the steps whose peak the profiler measures (it slows a step)


def own_param_bytes(model, sharded: bool, dtype) -> int:
    """This rank's parameters as the step keeps them, counted on the parameters it holds: sharded, the fp32 rows of
    its own shards (plan.master_bytes counts the fullest rank's, the one the budget is planned for; FSDP2's uneven
    split leaves the last ranks fewer rows); else every parameter in `dtype`."""
    if not sharded:
        return sum(p.numel() for p in model.parameters()) * dtype.itemsize
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * (4 if p.requires_grad else p.element_size())
               for p in model.parameters())     # LoRA's frozen base has no fp32 master (run/lora.py)


def micro_batches(corpus, step, *, n: int, seed: int, part: tuple[int, int], dev) -> list[tuple]:
    """Step n's (ids, labels, position ids or None) for this dp rank, split into its --grad-accum micro-batches."""
    ids, labels, pos = batch_inputs(corpus, seq_len=step.seq_len, batch=step.global_batch, step=n, seed=seed,
                                    part=part, packing=step.packing)
    k = step.rank_batch

    def t(x, i):
        return None if x is None else torch.from_numpy(x[i * k:(i + 1) * k]).to(dev, copy=True)
    out = []
    for i in range(step.grad_accum):
        x = t(ids, i)
        out.append((x, x if labels is ids else t(labels, i), t(pos, i)))
    return out


def evaluate(sharded, params: dict, corpus, step, *, batches: int, seed: int, part: tuple[int, int],
             dev) -> float | None:
    """The mean loss over the labelled tokens of `batches` held-out batches (the same ones every time), forward
    only, each the size of a training micro-batch (the same compiled program), over every dp rank's part
    (token_mean.evaluate); None when they hold no labelled token."""
    from autosp.run.data import batch_inputs as inputs
    held = []
    for b in range(batches):
        arrays = inputs(corpus, seq_len=step.seq_len, batch=step.rank_batch * step.dp, step=b, seed=seed, part=part,
                        packing=step.packing)
        held.append(tuple(None if x is None else torch.from_numpy(x).to(dev) for x in arrays))
    return token_mean.evaluate(sharded, params, held, step.sp, step.dp)


class _Logs:
    """Rank 0's outputs: metrics.jsonl, TensorBoard events (OUT/tb), the progress bar, the run's config.json and
    tokenizer (what `autosp export` and `autosp eval` read), opened once the first step has run."""

    def __init__(self, a, spec, tok, start: int, record: dict | None = None):
        self.a, self.spec, self.tok, self.start = a, spec, tok, start
        self.record = record or {}          # more for the run record (LoRA: how the base is rebuilt)
        self.writer = self.bar = self.tb = None

    def open(self) -> None:
        a = self.a
        os.makedirs(a.out, exist_ok=True)
        from autosp.run.inputs import RUN_RECORD
        self.spec.config.to_json_file(os.path.join(a.out, "config.json"))
        kept = None if self.tok is None else "bytes" if self.tok.path == "bytes" else "tokenizer"
        if kept == "tokenizer":
            self.tok.load().save_pretrained(os.path.join(a.out, "tokenizer"))
        with open(os.path.join(a.out, RUN_RECORD), "w") as f:
            json.dump({"model": a.step.model, "tokenizer": kept, "step": a.step.argv(), **self.record}, f, indent=1)
        mpath = os.path.join(a.out, "metrics.jsonl")
        metrics.truncate(mpath, self.start)
        self.writer = metrics.Writer(mpath)
        self.bar = _bar(self.start, a.steps)
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(a.out, "tb"), purge_step=self.start + 1)
        except ImportError:
            self.tb = None

    def write(self, row: dict) -> None:
        if self.writer is None:
            self.open()
        self.writer.write(row)
        if self.tb is not None:
            n = row["step"]
            for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                             ("tokens_per_s", "train/tokens_per_s"), ("eval_loss", "eval/loss"),
                             ("eval_perplexity", "eval/perplexity"), ("reward_margin", "dpo/reward_margin"),
                             ("reward_accuracy", "dpo/reward_accuracy")):
                if row.get(key) is not None:
                    self.tb.add_scalar(tag, row[key], n)
            self.tb.add_scalar("memory/predicted_MiB", max(row["predicted_peak_bytes"]) / 2**20, n)
            measured = [m for m in row["peak_mem_bytes"] if m is not None]
            if measured:
                self.tb.add_scalar("memory/measured_MiB", max(measured) / 2**20, n)
            self.tb.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.tb is not None:
            self.tb.close()


def _train(a, world: int, dev: torch.device, value_and_grad) -> None:
    from autosp.memory import StepMeter
    from autosp.remat.offload import _host_pool, _pinned_pool
    from autosp.run.answer import Fit, model_state
    from autosp.run.models import rope_of
    from autosp.run.plan import master_bytes
    rank = dist.get_rank()
    step = a.step
    sp = step.sp
    dp = world // sp
    mesh = _mesh(dev.type, dp, sp)
    dp_rank = rank // sp                         # the mesh is (dp, sp), row-major over global ranks
    meter = StepMeter(dev, MEASURED_STEPS)       # before the model: CPU counts every byte allocated from here

    spec = spec_of(step)
    tok, inputs = a.tok, a.inputs                # cli.check_train's: the launcher tokenized, this rank opened the cache
    corpus = inputs.corpus
    model = build_model(spec, seed=a.seed, device=str(dev))
    lora = step.lora
    if lora is not None:                         # peft's adapters train, the base is frozen in the compute dtype
        from autosp.run import lora as lora_
        model = lora_.apply(model, lora)
        lora_.freeze_dtype(model, step.dtype)
    model.train()
    sharded = step.sharded
    state_model = model_state(step, master_bytes(model, world, sharded, step.dtype),
                              None if lora is None else lora_.adapter_bytes(model, world, sharded))
    if sharded:
        from autosp.params import shard_params
        shard_params(model, mesh, param_dtype=None if step.precision == "fp32" else step.dtype,
                     reduce_dtype=step.grad_dtype)
    opt = make_optimizer(model, lr=a.lr, weight_decay=a.weight_decay, offload=step.optimizer_offload,
                         kind=step.optimizer)
    if not sharded and step.precision != "fp32":  # ZeRO-Offload on one rank: fp32 masters on host, bf16 on the device
        model.to(step.dtype)
    warmup = a.warmup if a.warmup is not None else max(1, min(100, a.steps // 10))
    sched = make_schedule(opt, warmup=warmup, total=a.steps, floor=a.min_lr_ratio)
    rope = rope_of(spec.config)
    state = {"step": 0, "scheduler": sched.state_dict(), "seed": a.seed, "seq_len": step.seq_len,
             "batch": step.global_batch, "rope": json.dumps(rope, sort_keys=True)}

    start = 0
    resumed = checkpoint.latest(a.out) if a.resume else None
    if resumed is not None:
        state = checkpoint.load(resumed, model, opt, state)
        sched.load_state_dict(state["scheduler"])
        start = int(state["step"])
        for key, now in (("seed", a.seed), ("seq_len", step.seq_len), ("batch", step.global_batch)):
            if state.get(key) != now:
                _say(f"note: the checkpoint was trained with --{key.replace('_', '-')} {state.get(key)}, "
                     f"this run uses {now}: the data order changes from here on")
        if state.get("rope") != json.dumps(rope, sort_keys=True):
            _say(f"note: the checkpoint was trained with RoPE {state.get('rope')}, this run uses {rope}")
        state["rope"] = json.dumps(rope, sort_keys=True)
    if a.resume and resumed is None:
        _say(f"note: --resume, but {a.out} holds no complete checkpoint yet: starting at step 0")
    if start >= a.steps:
        meter.close()
        _say(f"{resumed} is at step {start}, which already reaches --steps {a.steps}. Pass a larger --steps "
             "to train further.")
        return

    params, frozen = (dict(model.named_parameters()), None) if lora is None else lora_.split(model)
    # the mean over the labelled tokens of the whole global batch, whatever each dp rank holds (token_mean.py)
    loss_fn = token_mean_loss(model)

    dpo = step.objective == "dpo"                # preference pairs: run/dpo.py's loss, reference and batches
    if dpo:
        from autosp.run import dpo as D
        loss_fn = D.dpo_loss(model, step.beta)
    if lora is not None:                         # (adapters, base, ...): only the adapters are differentiated
        whole = loss_fn

        def loss_fn(adapters, base, *rest):
            return whole({**base, **adapters}, *rest)

    # the step as `autosp plan --seq-len` planned it: the same budget, host capacity, tiling and ring (the fullest
    # rank's model state); `own`: this rank's, what its prediction counts
    fit = Fit(step, state_model, step.token_bytes())
    own = Fit(step, model_state(step, own_param_bytes(model, sharded, step.dtype),
                                None if lora is None else lora_.own_adapter_bytes(model)), step.token_bytes())
    fit.budget = step.step_budget(fit.resident)
    fit.host_cap = step.activation_host_bytes(state_model.host)
    step_fn = value_and_grad(loss_fn, mesh, memory_budget=1.0 if fit.budget is None else fit.budget,
                             host_bandwidth=step.host_bandwidth, host_memory=fit.host_cap, ring=step.ring,
                             tiles=None if step.tile else {}, compile=a.compile, has_aux=dpo)
    if frozen is not None:                       # called, planned and evaluated with the adapters, as full training
        step_fn = lora_.Bound(step_fn, frozen)
    part = (dp_rank, dp)
    if dpo:
        table, ref_key, ref_new, ref_line = D.prepare_reference(
            a, step, inputs.pairs, model, params if frozen is None else {**frozen, **params}, mesh, start=start,
            part=part, dev=dev)
        first = D.micro_batches(inputs.pairs, table, step, n=start, seed=a.seed, part=part, dev=dev)[0]
    else:
        first = with_divisor(micro_batches(corpus, step, n=start, seed=a.seed, part=part, dev=dev), sp, dp)[0]
    plan = step_fn.plan(params, *first)
    del first
    # this rank's plan (compiling the step above refused a budget it cannot meet) and its own model state; a step
    # before the optimizer has state (a fresh run's first) peaks without the moments, or in its update, which
    # makes them while the gradients are live (parameters, gradients and moments: a short step's peak is below it)
    predicted = own.resident + plan.const_bytes + plan.peak_bytes
    first = max(predicted - own.state.moments, own.state.total + plan.const_bytes)
    tokens_per_step = step.global_batch * step.seq_len * (2 if dpo else 1)
    n_params = count_parameters(model)
    accum = f" in {step.grad_accum} micro-steps" if step.grad_accum > 1 else ""
    _say(f"autosp train: {describe(spec)}, {n_params / 1e6:.2f}M parameters\n"
         f"  ranks {world} = dp {dp} x sp {sp}" + (f" (ring {step.ring})" if step.ring else "")
         + f" on {dev.type} ({'nccl' if dev.type == 'cuda' else 'gloo'}), {step.precision}; "
         f"global batch {step.global_batch} x {step.seq_len} tokens{accum}; {a.steps} steps, lr {a.lr} (warmup "
         f"{warmup}, cosine)\n"
         f"  data: {corpus.name}, {corpus.length:,} tokens = {corpus.sequences(step.seq_len):,} sequences"
         + _whole_line(corpus, step.seq_len) + f"; packing {step.packing}"
         + (f"; held out: {inputs.heldout.length:,} tokens, evaluated every {a.eval_every} steps"
            if inputs.heldout is not None and a.eval_every else "") + "\n"
         + (f"  RoPE: {rope}, {spec.config.max_position_embeddings:,} positions\n"
            if step.rope_scaling or step.rope_theta else "")
         + (f"  DPO: {step.global_batch} pairs per step = {2 * step.global_batch} sequences; {ref_line}\n" if dpo else "")
         + f"{_memory_lines(own, plan, step)}\n"
         f"  measured: {meter.kind}" + ("" if dev.type == "cuda" else f", steps 1-{MEASURED_STEPS}") + "\n"
         f"  {_state_line(model, world, dev, sharded, step.optimizer_offload, 2 if step.optimizer == 'adamw' else 0)}"
         + ("" if lora is None else "\n" + lora_.banner(lora, model, frozen, world, sharded, sp))
         + (f"\n  resumed from {resumed} (step {start})" if resumed else ""))

    logs = (_Logs(a, spec, tok, start, None if lora is None else lora_.record(lora, model, spec, a.seed, dev.type))
            if rank == 0 else None)
    first_loss = last_loss = None
    run_losses: list[float] = []
    worst = None                                 # (measured - predicted) / predicted, each rank against its own
                                                 # prediction: the largest seen
    pool = _pinned_pool if dev.type == "cuda" else _host_pool
    t_start = time.perf_counter()
    meter.begin()
    for n in range(start + 1, a.steps + 1):
        faults.maybe_fail("step", n)
        t0 = time.perf_counter()
        mine = predicted if opt.state else first
        if dpo:
            micro = D.micro_batches(inputs.pairs, table, step, n=n - 1, seed=a.seed, part=part, dev=dev)
            loss, margins = D.accumulated_step(step_fn, params, micro)
        else:
            micro = with_divisor(micro_batches(corpus, step, n=n - 1, seed=a.seed, part=part, dev=dev), sp, dp)
            loss = accumulated_step(step_fn, params, micro)
        del micro
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), a.clip) if a.clip > 0 else None
        if norm is not None and hasattr(norm, "full_tensor"):  # sharded gradients: a replicated DTensor
            norm = norm.full_tensor()
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_v, norm = float(loss), None if norm is None else float(norm)     # not into the next step's peak
        del loss
        dt = time.perf_counter() - t0
        peak = meter.lap()
        # float64 holds byte counts exactly (below 2**53)
        mem = torch.tensor([-1 if peak is None else peak, pool.nbytes(), mine], dtype=torch.float64, device=dev)
        mems = [torch.zeros_like(mem) for _ in range(world)]
        dist.all_gather(mems, mem)
        measured = [None if m[0] < 0 else int(m[0].item()) for m in mems]
        host = [int(m[1].item()) for m in mems]
        predictions = [int(m[2].item()) for m in mems]
        del mem, mems                            # not into the next step's peak
        extra = D.step_metrics(margins, sp) if dpo else {}
        if measured[0] is not None:
            off = max((m - p) / p for m, p in zip(measured, predictions))
            worst = off if worst is None else max(worst, off)
        if a.compile and n == start + 1:
            secs, cache = step_fn.sharded.compile_report()
            _say(f"  compiled by inductor in {secs:.1f} s ({'warm: its on-disk cache' if cache == 'hit' else 'cold' if cache == 'miss' else 'partly from its on-disk cache'})")
        eval_loss = None
        if inputs.heldout is not None and a.eval_every and (n % a.eval_every == 0 or n == a.steps):
            eval_loss = evaluate(step_fn.sharded, params, inputs.heldout, step, batches=a.eval_batches,
                                 seed=a.seed, part=part, dev=dev)
        if rank == 0:
            row = {"step": n, "loss": loss_v, "lr": lr, "grad_norm": norm,
                   "tokens": n * tokens_per_step, "step_s": dt, "tokens_per_s": tokens_per_step / dt,
                   "peak_mem_bytes": measured, "predicted_peak_bytes": predictions,
                   "memory_bytes": step.memory_bytes, "host_bytes": host, "peak_mem_kind": meter.kind}
            if eval_loss is not None:
                row.update(eval_loss=eval_loss, eval_perplexity=math.exp(min(eval_loss, 50.0)))
            row.update(extra)
            logs.write(row)
            if dpo and n == start + 1 and ref_new:   # the run folder exists now: --resume reads the table back
                D.save_reference(a.out, table, ref_key)
            shown = ("measured " + " ".join(f"r{i} {m / 2**20:.1f}M" for i, m in enumerate(measured))
                     if measured[0] is not None else "")
            told = (f"{predictions[0] / 2**20:.1f}M" if len(set(predictions)) == 1 else
                    " ".join(f"r{i} {p / 2**20:.1f}M" for i, p in enumerate(predictions)))
            mem_text = f"{shown} / predicted {told}".lstrip()
            ev = f" | eval {eval_loss:.4f}" if eval_loss is not None else ""
            if logs.bar is not None:
                logs.bar.set_postfix_str(f"loss {loss_v:.4f}{ev} | {tokens_per_step / dt:,.0f} tok/s | {mem_text}")
                logs.bar.update(1)
            elif n % max(1, a.steps // 20) == 0 or n == a.steps or eval_loss is not None:
                print(f"step {n}/{a.steps}  loss {loss_v:.4f}{ev}  {tokens_per_step / dt:,.0f} tok/s  {mem_text}",
                      flush=True)
        first_loss = loss_v if first_loss is None else first_loss
        last_loss = loss_v
        run_losses.append(loss_v)
        if (a.save_every and n % a.save_every == 0) or n == a.steps:
            state = {**state, "step": n, "scheduler": sched.state_dict()}
            saved = checkpoint.save(a.out, n, model, opt, state)
            if logs is not None and logs.bar is not None:
                logs.bar.set_description(f"train (saved {os.path.basename(saved)})")
    meter.close()
    wall = time.perf_counter() - t_start
    if rank == 0:
        logs.close()
        png = metrics.plot_loss(os.path.join(a.out, "metrics.jsonl"), os.path.join(a.out, "loss.png"),
                                f"autosp train --model {step.model}: dp {dp} x sp {sp}, {step.global_batch} x "
                                f"{step.seq_len} tokens per step")
        k = min(10, len(run_losses))
        mean = f" (mean of the last {k} steps {sum(run_losses[-k:]) / k:.4f})" if k > 1 else ""
        plot = (f"loss curve {png}" if png else
                "loss curve skipped: matplotlib is not installed (pip install 'autosp[train]')")
        held = ("" if worst is None else
                f"  memory     measured peak {'+' if worst >= 0 else ''}{100 * worst:.2f} % against each rank's own "
                f"prediction (rank 0: {predicted / 2**20:.2f} MiB; the worst rank and step measured)\n")
        tb = f"  tensorboard {os.path.join(a.out, 'tb')}\n" if logs.tb is not None else ""
        if a.export:                              # the checkpoint just written, whole, as a Hugging Face folder
            from autosp.run.export import export
            folder = os.path.join(a.out, "hf")
            if os.path.isdir(folder):
                import shutil
                shutil.rmtree(folder)
            export(a.out, folder, step=a.steps)
            tb += (f"  exported   {folder} (AutoModelForCausalLM.from_pretrained loads it)\n" if lora is None else
                   f"  exported   {folder}: the adapters (peft.PeftModel.from_pretrained(base, folder) loads them)\n")
        print(f"trained steps {start + 1}-{a.steps} in {wall:.0f} s: loss {first_loss:.4f} -> {last_loss:.4f}{mean}; "
              f"a uniform guess over the {spec.vocab} tokens scores ln {spec.vocab} = {math.log(spec.vocab):.3f}\n"
              f"{held}"
              f"  checkpoint {os.path.join(a.out, f'step-{a.steps}')}\n"
              f"  metrics    {os.path.join(a.out, 'metrics.jsonl')}\n"
              f"{tb}"
              f"  {plot}", flush=True)
    dist.barrier()                               # the others wait for rank 0's report (and export)

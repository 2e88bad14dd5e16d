"""DPO: the loss as single-device code that `autosp.shard` takes unchanged, the reference log-probabilities, and the
step `autosp train --objective dpo` runs.

    fn = dpo_loss(model, beta=0.1)                 # fn(params, ids, labels, ref) -> (loss, margins)
    step_fn = autosp.value_and_grad(fn, mesh, has_aux=True)
    (loss, margins), grads = step_fn(params, ids, labels, ref)      # ids, labels [2k, L]: k chosen, then k rejected

A step runs the chosen and the rejected sequence of each of its k pairs (pairs.pair_batch lays them out: the
chosen first, then the rejected in the same order). A sequence's log-probability of its answer is the sum, over its
answer tokens, of log_softmax(logits) at the label, the labels shifted as the model shifts them: a reduction over
the sharded sequence, which autosp resolves with one all-reduce, exact at every shard edge. The loss is the mean over
pairs of -logsigmoid(beta ((pc - rc) - (pr - rr))), p the policy's log-probabilities, r the reference's; the
margins beta ((pc - rc) - (pr - rr)) come back beside it (the reward margin and accuracy of metrics.jsonl).

The reference is the frozen starting model. `reference_logps` is where a run gets them for a batch: a table made by
one forward-only, sequence-parallel pass of the starting model over every pair, before its first step, kept in the
run folder (reference.npy) so that --resume reuses it. With LoRA the starting model is the base with its adapters
off, exactly: peft starts every adapter's B at zero, so the pass over the starting LoRA model adds zeros to the
base's outputs (no second copy of the model, nothing disabled inside the step).
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch
import torch.nn.functional as F

from autosp.errors import AutospError

REFERENCE = "reference.npy"          # in the run folder: [pairs, 2] float64, NaN where not computed


# ---------------------------------------------------------------- the loss (single-device code)

def sequence_logps(model, params, input_ids, labels):
    """Each sequence's log-probability of its labelled tokens, float32 [rows]: the next-token log-probabilities at
    the labels (shifted as the model shifts them: labels[t + 1] is scored by logits[t]), summed along the sequence."""
    logits = torch.func.functional_call(model, params, (input_ids,)).logits
    target = F.pad(labels, (0, 1), value=-100)[:, 1:]
    nll = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), ignore_index=-100, reduction="none")
    return -nll.view(target.shape).sum(-1)


def margins(logps, ref, beta: float):
    """beta ((pc - rc) - (pr - rr)) per pair, [k], of the log-probabilities of k chosen then k rejected sequences."""
    pairs = (logps - ref).view(2, -1)
    return beta * (pairs[0] - pairs[1])


def dpo_loss(model, beta: float):
    """fn(params, ids, labels, ref) -> (the mean over pairs of -logsigmoid(margin), the margins)."""
    def fn(params, input_ids, labels, ref):
        z = margins(sequence_logps(model, params, input_ids, labels), ref, beta)
        return -F.logsigmoid(z).mean(), z
    return fn


def token_bytes(pairs: int, seq_len: int) -> int:
    """What one rank's DPO step holds besides the step's own values: int64 ids and labels of 2 sequences per pair,
    their fp32 reference log-probabilities."""
    return 2 * pairs * (2 * 8 * seq_len + 4)


# ---------------------------------------------------------------- the reference

def reference_source(a) -> str:
    """Where this run's reference log-probabilities come from: the pass over the starting model, which with LoRA is
    the base with its adapters off (their B starts at zero: the module docstring)."""
    return "precomputed" if not getattr(a, "lora_r", None) else "precomputed (LoRA: the base, adapters at zero)"


def reference_logps(table: np.ndarray, pairs: list[int], dev) -> torch.Tensor:
    """The reference log-probabilities of a batch's sequences, float32 [2k]: the k chosen, then the k rejected."""
    got = table[pairs]                                               # [k, 2]
    return torch.from_numpy(np.ascontiguousarray(got.T.reshape(-1))).to(dev, torch.float32)


def reference_table(out: str, cache, key: str) -> np.ndarray:
    """The run folder's table if it was made for these pairs (`key`), else an empty one (NaN)."""
    path = os.path.join(out, REFERENCE)
    meta = os.path.join(out, "reference.json")
    if os.path.isfile(path) and os.path.isfile(meta):
        with open(meta) as f:
            if json.load(f).get("key") == key:
                table = np.load(path)
                if table.shape == (cache.pairs, 2):
                    return table
    return np.full((cache.pairs, 2), np.nan)


def save_reference(out: str, table: np.ndarray, key: str) -> None:
    np.save(os.path.join(out, REFERENCE), table)
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"key": key, "computed": int(np.isfinite(table[:, 0]).sum()), "pairs": len(table)}, f)


def reference_pass(table: np.ndarray, logps_fn, params, cache, step, *, part, dev) -> int:
    """Fill `table` with the frozen model's log-probabilities of every pair it lacks, forward only, in batches of a
    step's shape (one compiled program; the last batch filled up with pairs from the start), each dp rank its part of
    each batch; the ranks' rows summed into every rank's table. Every pair, not only those the first --steps read:
    a later --resume with more steps finds its pairs there (the starting model is gone by then). Returns the
    number of pairs computed."""
    import torch.distributed as dist

    from autosp.run.pairs import rows_batch
    todo = np.flatnonzero(~np.isfinite(table[:, 0])).tolist()
    sums = np.zeros_like(table)
    counts = np.zeros(len(table))
    batch, k = step.global_batch // step.grad_accum, step.rank_batch      # pairs per micro-step, per dp rank
    r, _ = part
    with torch.no_grad():
        for b in range(0, len(todo), batch):
            rows = [todo[(b + j) % len(todo)] for j in range(batch)]
            mine, ids, labels = rows_batch(cache, rows[r * k:(r + 1) * k])
            lp = logps_fn(params, torch.from_numpy(ids).to(dev), torch.from_numpy(labels).to(dev))
            for i, v in zip(mine, lp.double().cpu().numpy().reshape(2, -1).T):      # [k, 2]
                sums[i] += v
                counts[i] += 1
    both = torch.from_numpy(np.concatenate([sums, counts[:, None]], axis=1))
    dist.all_reduce(both)                        # each sp rank of a dp group computed the same rows
    both = both.numpy()
    fresh = both[:, 2] > 0
    table[fresh] = both[fresh, :2] / both[fresh, 2:]
    return int(fresh.sum())


# ---------------------------------------------------------------- the step

def micro_batches(cache, table, step, *, n: int, seed: int, part, dev) -> list[tuple]:
    """Step n's (ids, labels, reference log-probabilities) for this dp rank, one per --grad-accum micro-step."""
    from autosp.run.pairs import pair_batch
    rows, ids, labels = pair_batch(cache, batch=step.global_batch, step=n, seed=seed, part=part)
    k = step.rank_batch
    out = []
    for i in range(step.grad_accum):
        sel = np.r_[i * k:(i + 1) * k, len(rows) + i * k:len(rows) + (i + 1) * k]
        out.append((torch.from_numpy(ids[sel]).to(dev), torch.from_numpy(labels[sel]).to(dev),
                    reference_logps(table, rows[i * k:(i + 1) * k], dev)))
    return out


def accumulated_step(step_fn, params: dict, micro: list[tuple]):
    """(loss, margins of this rank's pairs) of a step over its micro-batches, the gradients summed into each
    parameter's .grad: every micro-batch holds as many pairs, so each weighs 1 / micro-steps (the loss is a mean
    over pairs)."""
    from autosp.run.token_mean import add_grads
    w = 1.0 / len(micro)
    loss, zs = None, []
    for ids, labels, ref in micro:
        (part, z), grads = step_fn(params, ids, labels, ref)
        zs.append(z)
        part = part if len(micro) == 1 else part * w
        loss = part if loss is None else loss + part
        add_grads(params, grads, None if len(micro) == 1 else w)
        del grads
    return loss, torch.cat(zs)


def step_metrics(z: torch.Tensor, sp: int) -> dict:
    """The step's reward margin (mean over its pairs of beta ((pc - rc) - (pr - rr))) and reward accuracy (the share
    of pairs whose chosen answer's implicit reward is above the rejected one's), over every dp rank's pairs."""
    import torch.distributed as dist
    t = torch.tensor([float(z.sum()), float((z > 0).sum()), float(z.numel())], dtype=torch.float64)
    dist.all_reduce(t)                           # each sp rank holds its dp rank's pairs: every pair counted sp times
    return {"reward_margin": float(t[0] / t[2]), "reward_accuracy": float(t[1] / t[2])}


class PairData:
    """What train's banner says of its data (the corpus' name, tokens and sequences), for a PairCache."""

    def __init__(self, cache):
        self.cache = cache
        cut = cache.meta["cut"]
        self.name = cache.name + (f"; {cut:,} cut from the prompt's start to fit --seq-len {cache.meta['seq_len']}"
                                  if cut else "; none cut")
        self.length = 2 * cache.pairs * cache.meta["seq_len"]
        self.max_token = None
        self.documents = None

    def sequences(self, seq_len: int) -> int:
        return 2 * self.cache.pairs


def check_pairs(cache, step, vocab: int) -> None:
    """Errors a DPO run would otherwise meet mid-way: fewer pairs than a step takes, ids beyond the vocabulary."""
    if cache.pairs < step.global_batch:
        raise AutospError(f"--data: {cache.pairs} preference pairs, fewer than --batch {step.global_batch} pairs per "
                          f"step. Fix: --batch {max(step.dp * step.grad_accum, 1)} or more pairs.")
    if cache.meta["vocab"] > vocab:
        raise AutospError(f"--tokenizer {cache.meta['tokenizer']}: {cache.meta['vocab']:,} token ids, more than the "
                          f"model's vocabulary of {vocab:,}. Fix: the tokenizer the model was trained with.")


# ---------------------------------------------------------------- the run's inputs

class PairInputs:
    """inputs.Inputs for a DPO run: the pairs' cache, what the banner says of it, no held-out part."""

    def __init__(self, cache, note: str):
        self.pairs, self.corpus, self.heldout, self.packing, self.note = cache, PairData(cache), None, "concat", note


def prepare(a, tok, vocab: int, step) -> PairInputs:
    """--data's preference pairs tokenized into their cache (by the launcher, or each node's local rank 0; the other
    processes wait for it, as inputs._tokenized does for text)."""
    import time

    from autosp.run import pairs
    if tok is None or tok.path == "bytes":
        raise AutospError(f"--objective dpo --data {a.data}: preference pairs are rendered with a tokenizer (and "
                          "conversations with its chat template). Fix: --tokenizer FOLDER, or a model folder with its "
                          "tokenizer.")
    if a.data is None or not pairs.is_pairs(a.data):
        raise AutospError(f"--objective dpo --data {a.data}: not preference pairs (rows with prompt, chosen and "
                          "rejected). Fix: JSONL, Parquet or a saved dataset with those three fields, as TRL's "
                          "DPOTrainer reads them.")
    if getattr(a, "eval_every", 0):
        raise AutospError("--objective dpo --eval-every: held-out pairs are evaluated by `autosp eval --objective "
                          "dpo` (preference accuracy). Fix: leave out --eval-every.")
    if os.environ.get("AUTOSP_LAUNCHED") or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        deadline = time.monotonic() + a.timeout
        while (cache := pairs.find(a.data, tok, step.seq_len, a.cache_dir)) is None:
            if time.monotonic() > deadline:
                raise AutospError(f"--data {a.data}: the pairs were not tokenized within --timeout {a.timeout:g} s. "
                                  "Fix: a longer --timeout.")
            time.sleep(0.5)
        note = "its cache"
    else:
        cache, reused = pairs.tokenize_pairs(a.data, tok, seq_len=step.seq_len, cache_dir=a.cache_dir)
        note = (f"{'reused the cache' if reused else 'tokenized it into the cache'} {cache.folder} ({cache.pairs:,} "
                f"pairs, {cache.meta['cut']:,} cut from the prompt's start to fit --seq-len {step.seq_len})")
    check_pairs(cache, step, vocab)
    return PairInputs(cache, f"--data: {note}")


# ---------------------------------------------------------------- the reference pass, planned

def reference_peak(tracer, length: int, device: str) -> int:
    """The per-rank peak of the reference pass at `length` (forward only: `sequence_logps` of the step's 2k
    sequences, sharded as the step is, its parameters gathered as the step gathers them); the inputs, counted with
    the model state and token ids, aside."""
    ids = torch.zeros(2 * tracer.batch, length, dtype=torch.long, device="meta")

    def fn(params, input_ids, labels):
        return sequence_logps(tracer.model, params, input_ids, labels)
    return forward_peak(fn, tracer.mesh, (tracer.params, ids, ids), device, ring=tracer.ring)


def forward_peak(fn, mesh, args, device: str, ring=None) -> int:
    """The memory model's peak of `autosp.shard(fn, mesh)(*args)` run forward only (no_grad: nothing saved), per
    rank: remat.liveness.simulate of its per-rank program, its inputs not counted."""
    import autosp
    from autosp.remat.liveness import simulate
    from autosp.trace import without_sources
    with without_sources():
        _, local = autosp.shard(fn, mesh, ring=ring).graphs(*args)
    return simulate(local, device=device).peak


def prepare_reference(a, step, cache, model, params, mesh, *, start: int, part, dev) -> tuple:
    """The reference log-probabilities of every pair: the run folder's table (a --resume), or the reference pass of
    the starting model before step 1. (table, its key, pairs computed now, the banner's line)."""
    import autosp
    reference_source(a)
    key = cache.key                              # the pairs as tokenized and laid out (data, tokenizer, --seq-len)
    table = reference_table(a.out, cache, key)
    before = int(np.isfinite(table[:, 0]).sum())
    if start > 0 and before < cache.pairs:       # the model is the checkpoint's now, not the starting one
        raise AutospError(f"--resume: {os.path.join(a.out, REFERENCE)} holds the reference log-probabilities of "
                          f"{before:,} of the {cache.pairs:,} pairs (made for other data or --seq-len), and the starting model "
                          "is gone. Fix: the --data, --tokenizer and --seq-len the run started with, or a new run "
                          "(--out) from the checkpoint's model.")
    fn = autosp.shard(lambda p, ids, labels: sequence_logps(model, p, ids, labels), mesh)
    computed = 0 if start > 0 else reference_pass(table, fn, params, cache, step, part=part, dev=dev)
    said = (f"reference: the frozen starting model, precomputed (forward only, sequence-parallel) for {computed:,} "
            f"pairs" + (f", {before:,} read from {os.path.join(a.out, REFERENCE)}" if before else "")
            + f"; beta {step.beta}")
    return table, key, computed, said

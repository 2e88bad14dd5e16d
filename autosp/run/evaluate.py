"""`autosp eval`: a run or a model folder, evaluated forward only and sequence-parallel.

    autosp eval --model runs/extend --data held.jsonl --seq-len 2048 --sp 2     # loss, perplexity, loss by position
    autosp eval --model runs/extend/hf --passkey --lengths 512,2048 --sp 2      # passkey retrieval

A long evaluation needs the ranks as much as training does: each rank holds s/P of every activation, through
`autosp.shard` of single-device code. The loss is the mean next-token loss over the labelled tokens of `--batches`
batches (packed as training packs them), and its curve over `--buckets` equal buckets of the positions in the
sequence (eval.png): whether the far positions learned. The passkey test hides a random five-digit number at a
depth of a filler text and asks for it back; a prompt counts as retrieved when the model's greedy choice at every
token of the answer is that token (teacher forcing: the same verdict as greedy decoding, in one forward pass).
On chat data (chat.py) the loss is on the assistant's answers (--loss-on assistant, the default) or on every
token (--loss-on all). Rank 0 writes eval.json and the PNGs into --out, by default the run or model folder read
(out_folder): never the working folder.
"""
from __future__ import annotations

import json
import math
import os
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autosp.errors import AutospError

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"


def bucket_loss(model, params, input_ids, labels, position_ids, buckets: int):
    """(sum of the next-token loss, number of labelled tokens) in each of `buckets` equal buckets of the positions:
    the loss the model computes, summed per bucket (labels shifted as the model shifts them)."""
    kwargs = {} if position_ids is None else {"position_ids": position_ids}
    logits = torch.func.functional_call(model, params, (input_ids,), kwargs).logits
    target = F.pad(labels, (0, 1), value=-100)[:, 1:]
    nll = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), ignore_index=-100, reduction="none")
    valid = (target != -100).float()
    length = target.shape[1]
    which = torch.arange(length, device=target.device) * buckets // length
    onehot = F.one_hot(which, buckets).float()                                     # [s, K]
    sums = ((nll.view(target.shape) * valid).unsqueeze(-1) * onehot).sum(dim=(0, 1))
    counts = (valid.unsqueeze(-1) * onehot).sum(dim=(0, 1))
    return sums, counts


def answer_hits(model, params, input_ids, labels, position_ids):
    """Per row: how many labelled tokens the model's greedy choice gets right, and how many are labelled."""
    kwargs = {} if position_ids is None else {"position_ids": position_ids}
    logits = torch.func.functional_call(model, params, (input_ids,), kwargs).logits
    target = F.pad(labels, (0, 1), value=-100)[:, 1:]
    labelled = target != -100
    return ((logits.argmax(-1) == target) & labelled).sum(dim=1), labelled.sum(dim=1)


def passkey_batch(tok, length: int, depth: float, samples: int, rng: np.random.Generator) -> tuple:
    """(ids, labels) [samples, length]: filler text with the key sentence at `depth`, the question, the answer; only
    the answer's tokens labelled."""
    def encode(text):
        return list(tok([text], add_special_tokens=False)["input_ids"][0])
    filler = encode(FILLER)
    question = encode(QUESTION)
    rows, labels = [], []
    for _ in range(samples):
        key = int(rng.integers(10000, 100000))
        needle = encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
        answer = encode(f" {key}")
        room = length - len(needle) - len(question) - len(answer)
        if room < 0:
            raise AutospError(f"--lengths {length}: shorter than the passkey prompt without filler "
                              f"({length - room} tokens). Fix: longer --lengths.")
        fill = (filler * (room // max(1, len(filler)) + 1))[:room]
        before = int(round(depth * room))
        ids = fill[:before] + needle + fill[before:] + question + answer
        rows.append(ids)
        labels.append([-100] * (length - len(answer)) + answer)
    return np.asarray(rows, dtype=np.int64), np.asarray(labels, dtype=np.int64)


def out_folder(model: str, run: str | None) -> str:
    """Where eval writes its JSON and PNGs without --out: the run folder, else the model folder (a config.json's
    folder); a preset has none, and the working folder is no default (files there get lost, or overwritten)."""
    if run:
        return run
    if os.path.isdir(model):
        return model
    if os.path.isfile(model):
        return os.path.dirname(os.path.abspath(model))
    raise AutospError(f"autosp eval --model {model}: a preset, with no run or model folder to write eval.json and "
                      "its PNGs into. Fix: --out DIR.")


def _mesh(device: str, dp: int, sp: int):
    from torch.distributed.device_mesh import init_device_mesh
    if dp == 1:
        return init_device_mesh(device, (sp,), mesh_dim_names=("sp",))
    return init_device_mesh(device, (dp, sp), mesh_dim_names=("dp", "sp"))


def build(a, dev):
    """The model to evaluate: a run's checkpoint (--step, default its newest), else the folder's weights (or a
    preset's random init), with --rope-* applied."""
    from autosp.run.checkpoint import checkpoints
    from autosp.run.models import build_model, spec_of
    step = a.step
    if checkpoints(step.model):
        from autosp.run.export import load_run
        model, _ = load_run(step.model, a.ckpt_step, (step.rope_theta, step.rope_scaling))
        return model.to(dev)
    return build_model(spec_of(step), seed=a.seed, device=str(dev))


def worker(a) -> None:
    """One rank of `autosp eval`."""
    import autosp
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    step = a.step
    if step.device == "cuda":
        torch.cuda.set_device(local_rank)
    dev = torch.device(step.device, local_rank) if step.device == "cuda" else torch.device("cpu")
    # on a GPU the group is bound to the rank's device: NCCL starts at once, and barriers run there
    dist.init_process_group("nccl" if step.device == "cuda" else "gloo", timeout=timedelta(seconds=a.timeout),
                            **({"device_id": dev} if step.device == "cuda" else {}))
    try:
        sp, dp = step.sp, world // step.sp
        mesh = _mesh(dev.type, dp, sp)
        dp_rank = dist.get_rank() // sp
        model = build(a, dev).eval()
        if step.precision != "fp32":
            model = model.to(step.dtype)
        params = {k: v.detach() for k, v in model.named_parameters()}
        if a.passkey:
            result = _passkey(a, model, params, mesh, dp_rank, dp, dev, autosp)
        elif step.objective == "dpo":
            from autosp.run.preference import evaluate as preference
            result = preference(a, model, params, mesh, dp_rank, dp, dev, autosp)
        else:
            result = _loss(a, model, params, mesh, dp_rank, dp, dev, autosp)
        if dist.get_rank() == 0:
            _report(a, result)
    except BaseException as exc:
        from autosp.run.launch import record_failure
        record_failure(exc)
        raise
    finally:
        dist.destroy_process_group()


def _loss(a, model, params, mesh, dp_rank, dp, dev, autosp) -> dict:
    from autosp.run.data import batch_inputs
    step, corpus = a.step, a.inputs.corpus

    def fn(params, input_ids, labels, position_ids):
        return bucket_loss(model, params, input_ids, labels, position_ids, a.buckets)

    sharded = autosp.shard(fn, mesh)
    sums = torch.zeros(a.buckets, dtype=torch.float64)
    counts = torch.zeros(a.buckets, dtype=torch.float64)
    with torch.no_grad():
        for b in range(a.batches):
            arrays = batch_inputs(corpus, seq_len=step.seq_len, batch=step.global_batch, step=b, seed=a.seed,
                                  part=(dp_rank, dp), packing=step.packing)
            s, c = sharded(params, *[None if x is None else torch.from_numpy(x).to(dev) for x in arrays])
            sums += s.double().cpu()
            counts += c.double().cpu()
    both = torch.cat([sums, counts])
    dist.all_reduce(both)                          # each sp rank holds its dp rank's sums: every one counted sp times
    sums, counts = both[:a.buckets], both[a.buckets:]
    loss_on = a.inputs.loss_on
    if float(counts.sum()) == 0:
        raise AutospError(f"autosp eval: the {a.batches} batches of {corpus.name} hold no token to score"
                          + (" (no assistant answer within them)" if loss_on == "assistant" else "") + ". Fix: more "
                          "--batches, a longer --seq-len" + (", or --loss-on all." if loss_on == "assistant" else "."))
    mean = float(sums.sum() / counts.sum())
    width = step.seq_len / a.buckets
    return {"kind": "loss", "model": step.model, "data": corpus.name, "seq_len": step.seq_len, "sp": step.sp,
            "batches": a.batches, "sequences": a.batches * step.global_batch, "tokens": int(counts.sum() / step.sp),
            "loss": mean, "perplexity": math.exp(min(mean, 50.0)), "packing": step.packing, "loss_on": loss_on,
            "buckets": [{"from": int(k * width), "to": int((k + 1) * width), "loss": float(s / c) if c else None,
                         "tokens": int(c / step.sp)} for k, (s, c) in enumerate(zip(sums, counts))]}


def _passkey(a, model, params, mesh, dp_rank, dp, dev, autosp) -> dict:
    step = a.step
    tok = a.tok.load()

    def fn(params, input_ids, labels, position_ids):
        return answer_hits(model, params, input_ids, labels, position_ids)

    sharded = autosp.shard(fn, mesh)
    rng = np.random.default_rng(a.seed)
    grid = []
    with torch.no_grad():
        for length in a.lengths:
            row = []
            for depth in a.depths:
                ids, labels = passkey_batch(tok, length, depth, a.samples, rng)
                mine = slice(dp_rank * len(ids) // dp, (dp_rank + 1) * len(ids) // dp)
                hit, need = sharded(params, torch.from_numpy(ids[mine]).to(dev),
                                    torch.from_numpy(labels[mine]).to(dev), None)
                right = torch.tensor([int(((hit == need) & (need > 0)).sum())], dtype=torch.float64)
                dist.all_reduce(right)
                row.append(float(right) / step.sp / a.samples)
            grid.append(row)
    return {"kind": "passkey", "model": step.model, "lengths": a.lengths, "depths": a.depths, "samples": a.samples,
            "sp": step.sp, "accuracy": grid}


def _report(a, result: dict) -> None:
    os.makedirs(a.out, exist_ok=True)
    name = "passkey" if result["kind"] == "passkey" else "eval"
    with open(os.path.join(a.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    png = os.path.join(a.out, f"{name}.png")
    if result["kind"] == "loss":
        lines = [f"autosp eval: {result['model']} on {result['data']}: {result['sequences']} sequences of "
                 f"{result['seq_len']:,} tokens ({result['packing']}), sp {result['sp']}",
                 f"  mean loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} over "
                 f"{result['tokens']:,} tokens" + (" (the assistant's answers: --loss-on assistant)"
                                                   if result.get("loss_on") == "assistant" else ""),
                 "  loss by position: " + ", ".join(f"{b['from']}-{b['to']}: "
                                                    f"{'-' if b['loss'] is None else format(b['loss'], '.3f')}"
                                                    for b in result["buckets"])]
        drawn = _plot_buckets(png, result)
    elif result["kind"] == "preference":
        from autosp.run.preference import lines
        lines, drawn = lines(result), None
    else:
        lines = [f"autosp eval --passkey: {result['model']}, {result['samples']} prompts per cell, sp {result['sp']}",
                 "| length \\ depth | " + " | ".join(f"{d:g}" for d in result["depths"]) + " |",
                 "|---|" + "---|" * len(result["depths"])]
        lines += [f"| {n:,} | " + " | ".join(f"{x:.2f}" for x in row) + " |"
                  for n, row in zip(result["lengths"], result["accuracy"])]
        drawn = _plot_passkey(png, result)
    lines.append(f"  {os.path.join(a.out, name + '.json')}" + (f", {drawn}" if drawn else "" if result["kind"] ==
                                                              "preference" else " (no PNG: matplotlib is not installed)"))
    print("\n".join(lines), flush=True)


def _plot_buckets(png: str, r: dict) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    xs = [(b["from"] + b["to"]) / 2 for b in r["buckets"] if b["loss"] is not None]
    ys = [b["loss"] for b in r["buckets"] if b["loss"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, ys, marker="o")
    ax.set_xlabel("position in the sequence (bucket centre)")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title(f"{os.path.basename(os.path.normpath(r['model']))}: loss by position, {r['seq_len']:,} tokens",
                 fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def _plot_passkey(png: str, r: dict) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    grid = np.asarray(r["accuracy"])
    fig, ax = plt.subplots(figsize=(1.2 * len(r["depths"]) + 2, 0.6 * len(r["lengths"]) + 1.8))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(r["depths"])), [f"{d:g}" for d in r["depths"]])
    ax.set_yticks(range(len(r["lengths"])), [f"{n:,}" for n in r["lengths"]])
    ax.set_xlabel("depth of the key")
    ax.set_ylabel("prompt length (tokens)")
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="retrieved")
    ax.set_title(f"passkey retrieval: {os.path.basename(os.path.normpath(r['model']))}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png

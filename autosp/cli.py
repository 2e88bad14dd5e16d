"""The command line: `autosp train | plan | explain`.

    autosp train --model tiny --sp 2 --steps 200 --out runs/tiny      # 2 CPU ranks via torch.distributed.run
    autosp plan --model llama-3.1-8b --sp 8 --memory 80GiB             # longest trainable sequence, no run
    autosp explain --model tiny --seq-len 4096 --sp 2 --memory-budget 0.5

Bad input exits with code 2 and a message that says what to pass instead; nothing is written.
`autosp train` under an outer torchrun (RANK, WORLD_SIZE set) trains on the ranks it was given.
The verbs build transformers models: `pip install 'autosp[train]'` (transformers, tqdm for the progress
bar, matplotlib for the PNGs); `pip install autosp` alone gets exit code 2 and that command.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from autosp.errors import AutospError

_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "fp16": "float16", "float16": "float16"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}. Fix: see `{self.prog} --help`.\n")


def _budget(text: str | None):
    """--memory-budget: a fraction of the no-remat peak (0.5) or bytes per rank ('6GiB', 6e9)."""
    if text is None:
        return None
    from autosp.remat import parse_budget
    try:
        value = float(text)
    except ValueError:
        parse_budget(text)                      # '6GiB'; raises with the fix for anything else
        return text
    if value <= 1.0:
        parse_budget(value)
        return value
    if value != int(value):
        raise AutospError(f"--memory-budget {text}: a fraction is at most 1 and bytes are whole. Fix: 0.5 (half "
                          "the no-remat peak) or a size such as 6GiB.")
    return int(value)


def _positive(kind=int):
    def check(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'number' if kind is float else 'whole number'}")
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be positive")
        return value
    return check


def _nonneg(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be 0 or more")
    return value


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="autosp", description="Automatic sequence parallelism: train, plan and explain "
                                             "long-context training runs.")
    verbs = top.add_subparsers(dest="verb", metavar="{train,plan,explain}", parser_class=_Parser)

    t = verbs.add_parser("train", help="train a model on sp x dp ranks (torch.distributed.run)",
                         description="Train a causal LM with autosp on dp x sp ranks, launched through "
                                     "torch.distributed.run (or on the ranks of an outer torchrun).")
    t.add_argument("--model", default="tiny", help="preset (tiny, small, llama-3.2-1b, llama-3.2-3b, "
                   "llama-3.1-8b) or a Hugging Face config.json / model folder (default tiny)")
    t.add_argument("--sp", type=_positive(), default=None, help="sequence-parallel ranks (default: 2 on CPU, "
                   "the GPUs on CUDA, the launcher's world / dp under torchrun)")
    t.add_argument("--dp", type=_positive(), default=1, help="data-parallel ranks (default 1)")
    t.add_argument("--seq-len", type=_positive(), default=512, help="tokens per sequence (default 512)")
    t.add_argument("--batch", type=_positive(), default=None, help="sequences per step over all dp ranks "
                   "(default 4 x dp)")
    t.add_argument("--steps", type=_positive(), default=200, help="optimizer steps (default 200)")
    t.add_argument("--lr", type=_positive(float), default=3e-3, help="peak learning rate (default 3e-3)")
    t.add_argument("--warmup", type=_nonneg, default=None, help="warmup steps (default steps/10, at most 100)")
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: none)")
    t.add_argument("--memory-budget", default=None, help="autosp remat budget per rank: a fraction of the "
                   "no-remat peak (0.5) or bytes (6GiB); default: no remat")
    t.add_argument("--no-shard-params", dest="shard_params", action="store_false",
                   help="keep parameters, gradients and AdamW moments whole on every rank (default with more than "
                   "one rank: each one split on dim 0 over all ranks, FSDP2's layout)")
    t.add_argument("--optimizer-offload", action="store_true", help="keep AdamW's fp32 master weights and moments "
                   "in host memory and step them with torch's CPU AdamW (ZeRO-Offload)")
    t.add_argument("--data", default=None, help="token file (.npy, .bin) or text file; default: the Python "
                   "standard library's source as bytes")
    t.add_argument("--dtype", default="uint16", choices=["uint16", "uint32"], help="token type of a .bin file")
    t.add_argument("--out", default=None, help="run folder: checkpoints, metrics.jsonl, loss.png "
                   "(default runs/MODEL)")
    t.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    t.add_argument("--save-every", type=_nonneg, default=0, help="checkpoint every N steps (and always at the end)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    t.add_argument("--timeout", type=_positive(float), default=300.0,
                   help="seconds a collective waits for a silent rank before the run stops (default 300)")
    launcher = t.add_argument_group("launcher (passed to torch.distributed.run)")
    launcher.add_argument("--nnodes", default="1")
    launcher.add_argument("--nproc-per-node", type=_positive(), default=None, help="default: dp x sp / nnodes")
    launcher.add_argument("--node-rank", type=int, default=None)
    for flag in ("--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--master-addr",
                 "--master-port"):
        launcher.add_argument(flag, default=None)
    launcher.add_argument("--log-dir", default=None, help="per-rank logs (torchrun's --log-dir)")
    launcher.add_argument("--verbose", action="store_true", help="show the launcher's own log")

    p = verbs.add_parser("plan", help="the longest trainable sequence per rank, from the memory model",
                         description="Predict, without running anything, the longest sequence each rank can "
                                     "train: no SP, SP without remat, SP with autosp's ILP plan.")
    p.add_argument("--model", required=True, help="preset or Hugging Face config path")
    p.add_argument("--sp", type=_positive(), required=True, help="sequence-parallel ranks")
    p.add_argument("--dp", type=_positive(), default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--memory", required=True, help="memory per rank, e.g. 80GiB")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES), help="parameter and activation dtype")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"],
                   help="adamw: 2 fp32 moments per parameter; sgd: none")
    p.add_argument("--batch", type=_positive(), default=1, help="sequences per dp rank (default 1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda", help="cost model of the plan")
    p.add_argument("--offload", action="store_true", help="let the ILP plan offload to host memory (cuda)")
    p.add_argument("--granularity", type=_positive(), default=None,
                   help="report lengths as multiples of this (default sp x 64)")
    p.add_argument("--no-shard-params", dest="shard_params", action="store_false",
                   help="count the model state replicated on every rank (default: sharded over the dp x sp ranks "
                        "as autosp.shard_params / FSDP2 lay it out, fp32 master, gradients and moments)")
    p.add_argument("--no-tile", dest="tile", action="store_false", help="plan without tiling the MLPs and the "
                   "loss head along the sequence (faster to plan, shorter answers at long context)")
    p.add_argument("--optimizer-offload", action="store_true", help="count the model state as autosp train "
                   "--optimizer-offload keeps it: fp32 master copy, gradient copy and moments in host memory")
    p.add_argument("--host-memory", default=None, help="host memory per node, counted apart from the device, "
                   "e.g. 1TiB (default: 1 TiB assumed), shared by its min(ranks, 8) ranks: with --offload each "
                   "rank's share caps what its plan offloads")

    e = verbs.add_parser("explain", help="the sharded program and its remat plan, with a memory timeline PNG",
                         description="Print the sharded program's summary (layouts, collectives, remat plan) "
                                     "and plot the per-rank memory over one step, with and without the plan.")
    e.add_argument("--model", required=True, help="preset or Hugging Face config path")
    e.add_argument("--seq-len", type=_positive(), required=True)
    e.add_argument("--sp", type=_positive(), required=True)
    e.add_argument("--memory-budget", default="0.5", help="fraction (0.5) or bytes (6GiB); default 0.5")
    e.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES))
    e.add_argument("--batch", type=_positive(), default=1)
    e.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cost model of the plan")
    e.add_argument("--full", action="store_true", help="print every program, not the summary")
    e.add_argument("--png", default=None, help="timeline image (default explain-MODEL-sSEQ-spN.png)")
    return top


TRAIN_EXTRA = "pip install 'autosp[train]'"


def _require_transformers(verb: str) -> None:
    # Every verb's models are transformers causal LMs; `pip install autosp` leaves it out, since the
    # library (autosp.shard) never imports it.
    if importlib.util.find_spec("transformers") is None:
        raise AutospError(f"`autosp {verb}` needs transformers, which `pip install autosp` does not install. "
                          f"Fix: {TRAIN_EXTRA} (transformers, tqdm, matplotlib).")


# ---------------------------------------------------------------- train

def _in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_train(a) -> None:
    """Every check that needs no rank: bad input fails here, before anything is launched or written."""
    from autosp.run.checkpoint import checkpoints
    from autosp.run.data import check_corpus, open_corpus
    from autosp.run.models import peek_vocab
    if a.device is None:
        import torch
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif a.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise AutospError("--device cuda: no CUDA device is visible. Fix: --device cpu, or run on a GPU machine.")
    if a.sp is None:
        if _in_torchrun():
            a.sp = max(1, int(os.environ["WORLD_SIZE"]) // a.dp)
        elif a.device == "cuda":
            import torch
            a.sp = max(1, torch.cuda.device_count() // a.dp)
        else:
            a.sp = 2
    if a.batch is None:
        a.batch = 4 * a.dp
    if a.batch % a.dp:
        raise AutospError(f"--batch {a.batch} does not split over --dp {a.dp} ranks. Fix: a multiple of {a.dp}, "
                          f"e.g. --batch {a.dp * max(1, a.batch // a.dp)}.")
    if a.seq_len < 2:
        raise AutospError(f"--seq-len {a.seq_len}: a causal LM needs at least 2 tokens. Fix: --seq-len 512.")
    world = a.sp * a.dp
    if _in_torchrun() and int(os.environ["WORLD_SIZE"]) != world:
        raise AutospError(f"the launcher started {os.environ['WORLD_SIZE']} ranks, but --dp {a.dp} x --sp {a.sp} "
                          f"is {world}. Fix: --sp {int(os.environ['WORLD_SIZE']) // a.dp} (or leave --sp out).")
    nodes = str(a.nnodes).split(":")[-1]
    if not nodes.isdigit() or int(nodes) < 1:
        raise AutospError(f"--nnodes {a.nnodes}: expected a number of nodes (or MIN:MAX). Fix: --nnodes 1.")
    if not _in_torchrun() and a.nproc_per_node is None and world % int(nodes):
        raise AutospError(f"--dp {a.dp} x --sp {a.sp} = {world} ranks do not split over --nnodes {a.nnodes}. "
                          "Fix: pass --nproc-per-node, or a world size that is a multiple of the node count.")
    if a.min_lr_ratio < 0 or a.min_lr_ratio > 1:
        raise AutospError(f"--min-lr-ratio {a.min_lr_ratio}: a fraction of --lr in [0, 1]. Fix: --min-lr-ratio 0.1.")
    if a.clip < 0 or a.weight_decay < 0:
        raise AutospError("--clip and --weight-decay must be >= 0. Fix: --clip 1.0 --weight-decay 0.1.")
    a.memory_budget = _budget(a.memory_budget)
    check_corpus(open_corpus(a.data, a.dtype), a.seq_len, peek_vocab(a.model))
    if a.out is None:
        a.out = os.path.join("runs", os.path.basename(os.path.normpath(a.model)) or "model")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise AutospError(f"--out {a.out} is a file. Fix: pass a folder for the run (it is created).")
    done = checkpoints(a.out)
    has_metrics = os.path.isfile(os.path.join(a.out, "metrics.jsonl"))
    if not a.resume and (done or has_metrics):
        what = f"checkpoint step-{done[-1][0]}" if done else "metrics.jsonl"
        raise AutospError(f"--out {a.out} already holds a run ({what}). Fix: add --resume to continue it, or pass "
                          "another --out.")


def _train(a, argv) -> int:
    check_train(a)
    if _in_torchrun():
        return _worker(a)
    from autosp.run.launch import launch
    return launch(a, argv)


def _worker(a) -> int:
    from autosp.run.launch import LAUNCHED, record_failure
    from autosp.run.train import worker
    try:
        worker(a)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        record_failure(exc)
        if not os.environ.get(LAUNCHED):
            raise
        return 2 if isinstance(exc, AutospError) else 1
    return 0


# ---------------------------------------------------------------- plan, explain

def _plan(a) -> int:
    from autosp.run.plan import plan_lengths
    print(plan_lengths(a.model, sp=a.sp, dp=a.dp, memory=a.memory, dtype=_DTYPES[a.dtype], optimizer=a.optimizer,
                       batch=a.batch, device=a.device, offload=a.offload, granularity=a.granularity,
                       shard_params=a.shard_params, host_memory=a.host_memory,
                       optimizer_offload=a.optimizer_offload, tile=a.tile), flush=True)
    return 0


def _explain(a) -> int:
    from autosp.run.explain import explain_model
    budget = _budget(a.memory_budget)
    png = a.png or f"explain-{os.path.basename(os.path.normpath(a.model))}-s{a.seq_len}-sp{a.sp}.png"
    print(explain_model(a.model, seq_len=a.seq_len, sp=a.sp, budget=budget, dtype=_DTYPES[a.dtype], batch=a.batch,
                        device=a.device, full=a.full, png=png), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parser().parse_args(argv)
    if a.verb is None:
        parser().print_help(sys.stderr)
        return 2
    try:
        _require_transformers(a.verb)
        if a.verb == "train":
            return _train(a, argv)
        if a.verb == "plan":
            return _plan(a)
        return _explain(a)
    except AutospError as exc:
        rank = os.environ.get("RANK") if _in_torchrun() else None
        if rank is None or not os.environ.get("AUTOSP_LAUNCHED"):
            print(f"autosp {a.verb}: error{f' (rank {rank})' if rank else ''}: {exc}", file=sys.stderr, flush=True)
        if rank is not None:
            from autosp.run.launch import record_failure
            record_failure(exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())

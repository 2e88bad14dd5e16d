"""The command line: `autosp train | plan | explain`, one set of flags for what the step is (run/config.py).

    autosp plan --model tiny --sp 2 --memory 1GiB                     # the longest length; ends with the train command
    autosp plan --model tiny --sp 2 --memory 1GiB --seq-len 8192      # one length: fits or not, per-rank memory
    autosp train --model tiny --sp 2 --memory 1GiB --seq-len 8192     # planned before step 1; refused if it won't fit
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
from autosp.run.config import add_step_flags, positive as _positive


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}. Fix: see `{self.prog} --help`.\n")


def _nonneg(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be 0 or more")
    return value


VERBS = "{train,plan,explain,eval,export}"


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="autosp", description="Automatic sequence parallelism: plan, train, evaluate, export and "
                                             "explain long-context training runs.")
    verbs = top.add_subparsers(dest="verb", metavar=VERBS, parser_class=_Parser)
    _train_parser(verbs)
    _plan_parser(verbs)
    _explain_parser(verbs)
    _eval_parser(verbs)
    _export_parser(verbs)
    return top


def _train_parser(verbs) -> None:
    t = verbs.add_parser("train", help="train a model on sp x dp ranks (torch.distributed.run)",
                         description="Train a causal LM with autosp on dp x sp ranks, launched through "
                                     "torch.distributed.run (or on the ranks of an outer torchrun). With --memory "
                                     "the step is planned before the first one, and a length that does not fit is "
                                     "refused (exit 2).")
    add_step_flags(t, "train")
    r = t.add_argument_group("the run")
    r.add_argument("--steps", type=_positive(), default=200, help="optimizer steps (default 200)")
    r.add_argument("--lr", type=_positive(float), default=3e-3, help="peak learning rate (default 3e-3)")
    r.add_argument("--warmup", type=_nonneg, default=None, help="warmup steps (default steps/10, at most 100)")
    r.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr")
    r.add_argument("--weight-decay", type=float, default=0.1)
    r.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: none)")
    _data_flags(r)
    r.add_argument("--out", default=None, help="run folder: checkpoints, metrics.jsonl, loss.png, TensorBoard events "
                   "(default runs/MODEL)")
    r.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    r.add_argument("--save-every", type=_nonneg, default=0, help="checkpoint every N steps (and always at the end)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--eval-every", type=_nonneg, default=0, help="evaluate on held-out data every N steps (0: never)")
    r.add_argument("--eval-data", default=None, help="held-out data (as --data); default: the last --eval-fraction "
                   "of --data, which training then leaves out")
    r.add_argument("--eval-fraction", type=float, default=0.02, help="of --data held out for --eval-every (0.02)")
    r.add_argument("--eval-batches", type=_positive(), default=4, help="batches each evaluation reads (default 4)")
    r.add_argument("--compile", action="store_true", help="each rank's forward and backward programs through "
                   "inductor (the remat plan kept); the first step compiles, from inductor's on-disk cache when warm")
    r.add_argument("--export", action="store_true", help="at the end, write OUT/hf: a Hugging Face folder of the last "
                   "checkpoint (autosp export)")
    _launcher_flags(t)


def _data_flags(g, default: str = "the Python standard library's source as bytes (byte-level models)") -> None:
    g.add_argument("--data", default=None, help="text (.txt, .jsonl, .jsonl.gz, .parquet, a folder of them, or a "
                   "dataset saved with datasets' save_to_disk), tokenized once into a cache; or tokens (.npy, .bin); "
                   f"default: {default}")
    g.add_argument("--tokenizer", default=None, help="a saved Hugging Face tokenizer's folder (default: the model "
                   "folder's own; the byte-level presets read bytes)")
    g.add_argument("--text-field", default="text", help="the JSONL field / Parquet or dataset column of the text")
    g.add_argument("--cache-dir", default=None, help="where tokenized text is kept (default ~/.cache/autosp/tokens)")
    g.add_argument("--messages-field", default="messages", help="the JSONL field / Parquet or dataset column of a "
                   "conversation (a list of {role, content}): rows with it are chat data, rendered with the "
                   "tokenizer's chat template")
    g.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template to render chat data "
                   "with (default: the tokenizer's own)")
    g.add_argument("--loss-on", choices=["assistant", "all"], default=None, help="the tokens the loss is on: the "
                   "assistant's answers (the default for chat data) or all")
    g.add_argument("--token-dtype", default="uint16", choices=["uint16", "uint32"], help="token type of a .bin file")


def _launcher_flags(t) -> None:
    launcher = t.add_argument_group("launcher (passed to torch.distributed.run)")
    launcher.add_argument("--timeout", type=_positive(float), default=300.0,
                          help="seconds a collective waits for a silent rank before the run stops (default 300)")
    launcher.add_argument("--nnodes", default="1")
    launcher.add_argument("--nproc-per-node", type=_positive(), default=None, help="default: dp x sp / nnodes")
    launcher.add_argument("--node-rank", type=int, default=None)
    for flag in ("--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--master-addr",
                 "--master-port"):
        launcher.add_argument(flag, default=None)
    launcher.add_argument("--log-dir", default=None, help="per-rank logs (torchrun's --log-dir)")
    launcher.add_argument("--verbose", action="store_true", help="show the launcher's own log")


def _plan_parser(verbs) -> None:
    p = verbs.add_parser("plan", help="the longest trainable sequence per rank, or one length's memory; runs nothing",
                         description="Predict, without running anything, the longest sequence each rank can "
                                     "train within --memory (no SP, SP without remat, SP with autosp's ILP plan), "
                                     "or with --seq-len whether that length fits and its per-rank memory. Each "
                                     "answer that fits ends with the `autosp train` command that runs it.")
    add_step_flags(p, "plan")
    p.add_argument("--granularity", type=_positive(), default=None,
                   help="report lengths as multiples of this (default sp x 64)")


def _explain_parser(verbs) -> None:
    e = verbs.add_parser("explain", help="the sharded program and its remat plan, with a memory timeline PNG",
                         description="Print the sharded program's summary (layouts, collectives, remat plan) "
                                     "and plot the per-rank memory over one step, with and without the plan.")
    add_step_flags(e, "explain")
    e.add_argument("--full", action="store_true", help="print every program, not the summary")
    e.add_argument("--png", default=None, help="timeline image (default explain-MODEL-sSEQ-spN.png)")


def _eval_parser(verbs) -> None:
    v = verbs.add_parser("eval", help="evaluate a run or a model folder, sequence-parallel: loss by position, passkey",
                         description="Forward only, on sp x dp ranks: the mean loss and perplexity of --data and the "
                                     "loss per position bucket of the sequence (a PNG), or with --passkey the "
                                     "passkey retrieval accuracy per length and depth (a table and a heatmap PNG).")
    add_step_flags(v, "eval")
    _data_flags(v, default="with --passkey none; else required")
    v.add_argument("--step", dest="ckpt_step", type=_positive(), default=None,
                   help="a run's checkpoint (default: its newest)")
    v.add_argument("--batches", type=_positive(), default=8, help="batches of --data read (default 8)")
    v.add_argument("--buckets", type=_positive(), default=8, help="position buckets of the loss curve (default 8)")
    v.add_argument("--reference", default=None, help="preference pairs (--objective dpo, or --data with prompt, "
                   "chosen and rejected): the model the run started from, for DPO's implicit reward (default: none, "
                   "the policy's log-probabilities compared)")
    v.add_argument("--passkey", action="store_true", help="passkey retrieval instead of --data")
    v.add_argument("--lengths", default=None, help="passkey prompt lengths in tokens, e.g. 1024,4096 (default "
                   "--seq-len)")
    v.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="where the key sits, as fractions of the prompt")
    v.add_argument("--samples", type=_positive(), default=4, help="passkey prompts per length and depth (default 4)")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--out", default=None, help="folder for eval.json and the PNGs (default: the run or model "
                   "folder --model names)")
    _launcher_flags(v)


def _export_parser(verbs) -> None:
    x = verbs.add_parser("export", help="a run's checkpoint as a Hugging Face model folder",
                         description="Write a run's checkpoint (any world size wrote it) as a Hugging Face folder: "
                                     "config.json with the run's RoPE settings, safetensors in shards, the tokenizer's "
                                     "files. AutoModelForCausalLM.from_pretrained loads it.")
    x.add_argument("run", help="the run folder (autosp train --out)")
    x.add_argument("--step", dest="ckpt_step", type=_positive(), default=None,
                   help="the checkpoint (default: the newest)")
    x.add_argument("--out", required=True, help="the folder to write")
    x.add_argument("--shard-size", default="2GB", help="safetensors shard size (default 2GB)")
    x.add_argument("--merge", action="store_true", help="a LoRA run: the base with the adapters merged, a whole "
                   "Hugging Face folder (default: the adapter folder peft.PeftModel.from_pretrained loads)")


TRAIN_EXTRA = "pip install 'autosp[train]'"


def _require_transformers(verb: str) -> None:
    # Every verb's models are transformers causal LMs; `pip install autosp` leaves it out, since the
    # library (autosp.shard) never imports it.
    if importlib.util.find_spec("transformers") is None:
        raise AutospError(f"`autosp {verb}` needs transformers, which `pip install autosp` does not install. "
                          f"Fix: {TRAIN_EXTRA} (transformers, tqdm, matplotlib).")


# ---------------------------------------------------------------- train

def check_train(a, zygote: bool = False) -> None:
    """Every check that needs no rank: bad input fails here, before anything is launched or written. With
    --memory (or --memory-budget) the step is planned here as `autosp plan --seq-len` plans it, and a length
    that does not fit is refused with the longest that does. `zygote`: the ranks' zygote (run/zygote.py) starts
    importing as soon as the step is known (the launcher's; its caller closes it, launch.close_zygote)."""
    from dataclasses import replace

    from autosp.run.checkpoint import checkpoints
    from autosp.run.config import in_torchrun, step_of
    from autosp.run.inputs import prepare, tokenizer_for
    from autosp.run.models import peek_vocab
    if a.seq_len is None:
        a.seq_len = 512
    a.step = step = step_of(a, "train")
    if zygote:                                 # the ranks' zygote imports while this process checks and plans
        from autosp.run.launch import start_zygote
        start_zygote(a)
    world = step.world
    if in_torchrun() and int(os.environ["WORLD_SIZE"]) != world:
        raise AutospError(f"the launcher started {os.environ['WORLD_SIZE']} ranks, but --dp {step.dp} x --sp {step.sp} "
                          f"is {world}. Fix: --sp {int(os.environ['WORLD_SIZE']) // step.dp} (or leave --sp out).")
    nodes = str(a.nnodes).split(":")[-1]
    if not nodes.isdigit() or int(nodes) < 1:
        raise AutospError(f"--nnodes {a.nnodes}: expected a number of nodes (or MIN:MAX). Fix: --nnodes 1.")
    if not in_torchrun() and a.nproc_per_node is None and world % int(nodes):
        raise AutospError(f"--dp {step.dp} x --sp {step.sp} = {world} ranks do not split over --nnodes {a.nnodes}. "
                          "Fix: pass --nproc-per-node, or a world size that is a multiple of the node count.")
    if a.min_lr_ratio < 0 or a.min_lr_ratio > 1:
        raise AutospError(f"--min-lr-ratio {a.min_lr_ratio}: a fraction of --lr in [0, 1]. Fix: --min-lr-ratio 0.1.")
    if a.clip < 0 or a.weight_decay < 0:
        raise AutospError("--clip and --weight-decay must be >= 0. Fix: --clip 1.0 --weight-decay 0.1.")
    if not 0 < a.eval_fraction < 1:
        raise AutospError(f"--eval-fraction {a.eval_fraction}: a fraction of --data in (0, 1). Fix: --eval-fraction 0.02.")
    if step.lora is not None:                    # before anything is tokenized or launched
        from autosp.run.lora import check_targets
        check_targets(step)
    a.tok = tokenizer_for(step.model, a.tokenizer)
    if step.objective == "dpo":                  # preference pairs (run/pairs.py, run/dpo.py)
        from autosp.run.dpo import prepare as prepare_pairs
        a.inputs = inputs = prepare_pairs(a, a.tok, peek_vocab(step.model), step)
    else:
        a.inputs = inputs = prepare(a, a.tok, peek_vocab(step.model), step.seq_len)
    if inputs.note and not os.environ.get("AUTOSP_LAUNCHED"):
        print(f"autosp train: {inputs.note}", flush=True)
    # chat data's labels are the answers only: a tensor of their own beside the ids
    a.step = step = replace(step, packing=inputs.packing,
                            labels_apart=getattr(inputs.corpus, "answers", None) is not None)
    _warn_positions(step)
    if a.out is None:
        a.out = os.path.join("runs", os.path.basename(os.path.normpath(step.model)) or "model")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise AutospError(f"--out {a.out} is a file. Fix: pass a folder for the run (it is created).")
    done = checkpoints(a.out)
    has_metrics = os.path.isfile(os.path.join(a.out, "metrics.jsonl"))
    if not a.resume and (done or has_metrics):
        what = f"checkpoint step-{done[-1][0]}" if done else "metrics.jsonl"
        raise AutospError(f"--out {a.out} already holds a run ({what}). Fix: add --resume to continue it, or pass "
                          "another --out.")
    # the ranks of our own launcher were checked by it; a user's torchrun starts ranks that check themselves
    if (step.memory is not None or step.memory_budget is not None) and not os.environ.get("AUTOSP_LAUNCHED"):
        from autosp.run.answer import at_length
        # where --memory decides (the least peak within what it leaves), the verdict alone: each rank plans the step
        # itself (the plan made here too took 16.5 s of the 51 s of `autosp train --model tiny --sp 2 --seq-len 4096
        # --memory 24MiB --steps 2`); a refusal is planned again in full, for the longest length that fits
        fit = at_length(step, quick=step.memory is not None and step.memory_budget is None)
        if not fit.fits:
            raise AutospError(at_length(step).refusal())


def _warn_positions(step) -> None:
    """A length beyond the model's positions with no RoPE scaling trains positions it never saw: say so, with the flag."""
    if step.rope_scaling is not None or os.environ.get("AUTOSP_LAUNCHED"):
        return
    from autosp.run.models import peek_positions, spec_of
    positions = peek_positions(step.model)           # transformers' import is 2-3 s of the launcher's CPU
    if positions is None:
        positions = int(getattr(spec_of(step).config, "max_position_embeddings", 0) or 0)
    if positions and step.seq_len > positions:
        print(f"autosp: warning: --seq-len {step.seq_len:,} is beyond the model's {positions:,} positions and no "
              f"--rope-scaling is set. Fix: --rope-scaling yarn:{-(-step.seq_len // positions)} (or linear, dynamic, "
              "llama3) to extend its context.", file=sys.stderr, flush=True)


def _train(a, argv) -> int:
    from autosp.run.config import in_torchrun
    from autosp.run.launch import close_zygote, launch
    try:
        check_train(a, zygote=not in_torchrun())
        if in_torchrun():
            return _worker(a)
        return launch(a, argv)
    finally:
        close_zygote(a)


def _worker(a, worker=None) -> int:
    """One rank of a launched verb (train's worker by default): its failure recorded for the launcher to tell."""
    import faulthandler
    import signal

    from autosp.run.launch import LAUNCHED, record_failure
    if hasattr(signal, "SIGUSR1"):               # `kill -USR1 PID` prints where each thread of a rank is
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    if worker is None:
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
    from autosp.run.answer import answer, full_collections_rarely
    from autosp.run.config import step_of
    with full_collections_rarely():
        said = answer(step_of(a, "plan"), a.granularity)
    print(said.text, flush=True)
    if said.stored is not None:        # stdout is the answer as first printed; where it came from goes apart
        print(f"autosp plan: the answer kept when these flags were first planned, read from {said.stored} "
              "(AUTOSP_PLAN_CACHE=off plans afresh)", file=sys.stderr, flush=True)
    return 0 if said.ok else 2


def _explain(a) -> int:
    from autosp.run.config import step_of
    from autosp.run.explain import explain_model
    step = step_of(a, "explain")
    png = a.png or f"explain-{os.path.basename(os.path.normpath(step.model))}-s{step.seq_len}-sp{step.sp}.png"
    print(explain_model(step, full=a.full, png=png), flush=True)
    return 0


# ---------------------------------------------------------------- eval, export

def check_eval(a) -> None:
    """Every check of `autosp eval` that needs no rank; the text tokenized (once per node) before the ranks start."""
    from dataclasses import replace

    from autosp.run.checkpoint import checkpoints
    from autosp.run.config import in_torchrun, step_of
    from autosp.run.inputs import prepare, tokenizer_for
    from autosp.run.models import peek_vocab
    if a.passkey:
        try:
            a.lengths = [int(x) for x in (a.lengths or str(a.seq_len or 1024)).split(",")]
            a.depths = [float(x) for x in a.depths.split(",")]
        except ValueError:
            raise AutospError(f"--lengths {a.lengths} --depths {a.depths}: comma-separated numbers. Fix: --lengths "
                              "1024,4096 --depths 0,0.5,1.") from None
        if min(a.lengths) < 2 or not all(0 <= d <= 1 for d in a.depths):
            raise AutospError(f"--lengths {a.lengths} --depths {a.depths}: lengths of 2 tokens or more, depths in "
                              "[0, 1]. Fix: --lengths 1024,4096 --depths 0,0.5,1.")
        a.seq_len = max(a.lengths)
    if a.seq_len is None:
        a.seq_len = 512
    step = step_of(a, "eval")
    run = step.model if checkpoints(step.model) else None
    tok = a.tokenizer or (os.path.join(run, "tokenizer") if run and os.path.isdir(os.path.join(run, "tokenizer"))
                          else None)
    a.tok = tokenizer_for(step.model, tok)
    if a.out is None:                  # before anything is tokenized or written: never the working folder
        from autosp.run.evaluate import out_folder
        a.out = out_folder(step.model, run)
    if a.passkey:
        if a.tok is None:
            raise AutospError(f"--model {step.model}: no tokenizer to write the passkey prompts with. Fix: --tokenizer.")
        a.inputs = None
    else:
        if a.data is None:
            raise AutospError("autosp eval: no --data to evaluate on. Fix: --data FILE (as autosp train takes it), or "
                              "--passkey.")
        a.eval_every, a.eval_data = 0, None
        from autosp.run.pairs import is_pairs
        if step.objective == "dpo" or is_pairs(a.data):     # preference accuracy (run/preference.py)
            from autosp.run.dpo import prepare as prepare_pairs
            step = replace(step, objective="dpo")
            a.inputs = prepare_pairs(a, a.tok, peek_vocab(step.model), step)
        else:
            a.inputs = prepare(a, a.tok, peek_vocab(step.model), step.seq_len)
        if a.inputs.note and not os.environ.get("AUTOSP_LAUNCHED"):
            print(f"autosp eval: {a.inputs.note}", flush=True)
        step = replace(step, packing=a.inputs.packing)
    world = step.world
    if in_torchrun() and int(os.environ["WORLD_SIZE"]) != world:
        raise AutospError(f"the launcher started {os.environ['WORLD_SIZE']} ranks, but --dp {step.dp} x --sp {step.sp} "
                          f"is {world}. Fix: --sp {int(os.environ['WORLD_SIZE']) // step.dp} (or leave --sp out).")
    a.step = step


def _eval(a, argv) -> int:
    from autosp.run.config import in_torchrun
    from autosp.run.launch import close_zygote, launch
    try:
        check_eval(a)
        if in_torchrun():
            from autosp.run.evaluate import worker
            return _worker(a, worker)
        return launch(a, argv)
    finally:
        close_zygote(a)


def _export(a) -> int:
    from autosp.run.export import export
    path = export(a.run, a.out, step=a.ckpt_step, shard_size=a.shard_size, merge=a.merge)
    from autosp.run.lora import run_lora
    loads = ("AutoModelForCausalLM" if a.merge or run_lora(a.run) is None else "peft.PeftModel") + \
        f".from_pretrained({'base, ' if not a.merge and run_lora(a.run) else ''}{a.out!r})"
    print(f"autosp export: {path} -> {a.out} ({loads} loads it)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line's exit code; `argv` None: the process's own arguments (`autosp`, `python -m autosp`, and
    each rank a launch starts), and the process leaves as soon as the verb has answered (_leave)."""
    own = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parser().parse_args(argv)
    a.keep_zygote = not own             # called again in this process: a launch's zygote serves the next (launch.KEPT)
    if a.verb is None:
        parser().print_help(sys.stderr)
        return 2
    code = _verb(a, argv)
    if own:
        _leave(code)
    return code


def _verb(a, argv: list[str]) -> int:
    """Run the parsed verb; its exit code."""
    try:
        _require_transformers(a.verb)
        if a.verb == "train":
            return _train(a, argv)
        if a.verb == "plan":
            return _plan(a)
        if a.verb == "eval":
            return _eval(a, argv)
        if a.verb == "export":
            return _export(a)
        return _explain(a)
    except AutospError as exc:
        from autosp.run.config import in_torchrun
        rank = os.environ.get("RANK") if in_torchrun() else None
        if rank is None or not os.environ.get("AUTOSP_LAUNCHED"):
            print(f"autosp {a.verb}: error{f' (rank {rank})' if rank else ''}: {exc}", file=sys.stderr, flush=True)
        if rank is not None:
            from autosp.run.launch import record_failure
            record_failure(exc)
        return 2


def _leave(code: int) -> None:
    """End the process now, its output flushed. The interpreter's teardown frees torch's, dynamo's and
    transformers' modules and a plan's graphs one object at a time: 1.5-2 s of CPU in every process that built a
    model (a rank of `autosp train`, its launcher, `autosp plan`), on every launch. Nothing is left to write or
    close by then: each verb closes what it opened (the run's logs, tensorboard, checkpoints written whole and
    renamed into place, a failed rank's error file), a rank has left its process group, the launcher's agent has
    stopped, a plan's forked helpers were waited for; logging's handlers are flushed here, and a progress bar a
    failure left open is closed (as the teardown closed it), so that it ends its line before the launcher says why."""
    import logging
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

"""What a run reads: the tokenizer, the corpus (text tokenized once into its cache, text.py), the packing, and the
held-out part that evaluation reads.

    tok = tokenizer_for("models/llama", None)          # the model folder's own, "bytes" for the presets, or None
    inputs = prepare(a, tok, vocab)                    # tokenizes text (once per node), opens the corpus

The process that prepares a run (autosp's launcher, or each node's first local rank under a user's torchrun) is
the one that tokenizes; the ranks open the cache it wrote, so no text is tokenized twice.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from autosp.errors import AutospError
from autosp.run import text
from autosp.run.data import Corpus, check_corpus, open_corpus


@dataclass
class Inputs:
    corpus: Corpus                      # what the run trains on
    heldout: Corpus | None              # what --eval-every evaluates on
    packing: str                        # "docs" or "concat"
    note: str = ""                      # how the text came in (tokenized now, or the cache reused)
    loss_on: str = "all"                # "assistant": chat data's answer tokens only are labelled (chat.py)


def tokenizer_for(model: str, flag: str | None) -> text.Tokenizer | None:
    """--tokenizer as given; else the presets' bytes; else the tokenizer saved in the model's folder, if any."""
    from autosp.run.models import PRESETS
    if flag:
        return text.Tokenizer.of(flag)
    if model in PRESETS:
        return text.Tokenizer("bytes")
    folder = model if os.path.isdir(model) else os.path.dirname(os.path.abspath(model))
    record = os.path.join(folder, RUN_RECORD)            # a run folder: the tokenizer it was trained with
    if os.path.isfile(record):
        with open(record) as f:
            kept = json.load(f).get("tokenizer")
        if kept == "bytes":
            return text.Tokenizer("bytes")
        if kept:
            return text.Tokenizer.of(os.path.join(folder, kept))
    try:
        return text.Tokenizer.of(folder)
    except AutospError:
        return None


RUN_RECORD = "autosp.json"              # what a run folder says of how it was trained (train writes it)


def _corpus(path: str, tok, a, flag: str, notes: list[str]):
    """The corpus of --data or --eval-data: text tokenized into (or read back from) the cache, or token ids."""
    if not _is_text(path):
        return open_corpus(path, a.token_dtype)
    from autosp.run.data import corpus_of
    cache, note = _tokenized(path, tok, a, flag)
    notes.append(f"{flag}: {note}")
    return corpus_of(cache)


def _is_text(path: str | None) -> bool:
    return path is not None and (os.path.isdir(path) or path.endswith(text.TEXT_SUFFIXES))


def _tokenized(path: str, tok: text.Tokenizer | None, a, role: str) -> tuple[text.TokenCache, str]:
    """The cache of `path`: tokenized here (this node's preparing process), or waited for (another local rank)."""
    if tok is None:
        raise AutospError(f"{role} {path}: text, and the model has no tokenizer. Fix: --tokenizer FOLDER (a saved "
                          "Hugging Face tokenizer), or a model folder that holds its tokenizer's files.")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    from autosp.run import chat
    field, template = getattr(a, "messages_field", "messages"), getattr(a, "chat_template", None)
    conversations = chat.is_chat(path, field)
    if conversations:                                           # rendered by the chat template, answers masked
        def find():
            return chat.find(path, tok, field, template, a.cache_dir)
    else:
        def find():
            return text.find(path, tok, a.text_field, a.cache_dir)
    if os.environ.get("AUTOSP_LAUNCHED") or local != 0:         # the launcher or local rank 0 writes it
        deadline = time.monotonic() + a.timeout
        while (cache := find()) is None:
            if time.monotonic() > deadline:
                raise AutospError(f"{role} {path}: local rank 0 did not finish tokenizing it within --timeout "
                                  f"{a.timeout:g} s. Fix: a longer --timeout, or tokenize first (autosp train on one rank).")
            time.sleep(0.5)
        return cache, "its cache"
    if conversations:
        cache, reused = chat.tokenize(path, tok, messages_field=field, template_file=template, cache_dir=a.cache_dir,
                                      progress=os.environ.get("RANK", "0") == "0")
    else:
        cache, reused = text.tokenize(path, tok, text_field=a.text_field, cache_dir=a.cache_dir,
                                      progress=os.environ.get("RANK", "0") == "0")
    how = "reused the cache" if reused else "tokenized it into the cache"
    return cache, f"{how} {cache.folder} ({cache.meta['tokens']:,} tokens, {cache.meta['documents']:,} documents)"


def prepare(a, tok: text.Tokenizer | None, vocab: int, seq_len: int) -> Inputs:
    """The run's inputs from its flags (--data, --text-field, --cache-dir, --token-dtype, --packing, --eval-data,
    --eval-fraction); `vocab`: the model's, which the tokenizer and the tokens must fit."""
    notes = []
    from autosp.run.chat import check_loss_on, loss_on
    check_loss_on(a)
    if a.data is None and tok is not None and tok.path != "bytes":
        raise AutospError("--data: the default corpus is bytes, and this model has a tokenizer of its own. Fix: --data "
                          "with text it tokenizes (.jsonl, .parquet, .txt, a folder or a saved dataset), or tokens.")
    if tok is not None and _is_text(a.data):
        t_vocab, _ = tok.vocab_and_eos()
        if t_vocab > vocab:
            raise AutospError(f"--tokenizer {tok.path}: {t_vocab:,} token ids, more than the model's vocabulary of "
                              f"{vocab:,}. Fix: the tokenizer the model was trained with, or a model whose vocab_size "
                              f"is at least {t_vocab}.")
    corpus = _corpus(a.data, tok, a, "--data", notes)
    check_corpus(corpus, seq_len, vocab)
    heldout = None
    if a.eval_data is not None:
        heldout = _corpus(a.eval_data, tok, a, "--eval-data", notes)
        check_corpus(heldout, seq_len, vocab)
    elif a.eval_every:
        cut = int(corpus.length * (1 - a.eval_fraction))
        if corpus.length - cut < seq_len or cut < seq_len:
            raise AutospError(f"--eval-fraction {a.eval_fraction}: {corpus.length - cut:,} of {corpus.length:,} tokens "
                              f"held out, not a sequence of --seq-len {seq_len} on both sides. Fix: --eval-data, or "
                              "another --eval-fraction.")
        heldout = corpus.part(cut, corpus.length, f"the last {a.eval_fraction:g} of {corpus.name}")
        corpus = corpus.part(0, cut, corpus.name)
    corpus, heldout, chosen = loss_on(corpus, heldout, getattr(a, "loss_on", None))
    packing = a.packing or ("docs" if corpus.documents is not None else "concat")
    if packing == "docs" and corpus.documents is None:
        raise AutospError(f"--packing docs: {corpus.name} has no document boundaries (token files and the default "
                          "corpus are one stream). Fix: --packing concat, or text data (.jsonl, .parquet, .txt, ...).")
    return Inputs(corpus, heldout, packing, "; ".join(notes), chosen)

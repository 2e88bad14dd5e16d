"""Chat data in sequences: whole conversations (autosp/run/data.bins) against a fixed-stride cut of the stream, the
layout chat data had before. What each costs: answer tokens trained without their conversation's start (the cut's),
padding (the bins'), conversations longer than a sequence (kept from their end).

    python bench/chat_packing.py [--conversations 1000] [--turns 4 16] [--seq-len 1024 4096]

Synthetic conversations as bench/chat_tokenize.py makes them (`--turns` user/assistant pairs of 20 to 80 words), a
word-level BPE trained here, ChatML.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import json
    import random

    import numpy as np

    from autosp.run import chat, text
    from autosp.run.data import batch_inputs, bins, corpus_of
    from bench.chat_tokenize import tokenizer
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=1000)
    p.add_argument("--turns", type=int, nargs="+", default=[4, 16])
    p.add_argument("--seq-len", type=int, nargs="+", default=[1024, 4096])
    a = p.parse_args()
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(3000)]
    print("| turns | tokens a conversation (median) | seq len | cut: conversations split | cut: answer tokens without "
          "their conversation's start | whole: sequences | whole: padding | whole: kept from the end |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        tok = tokenizer(vocab * 3)
        tok.save_pretrained(os.path.join(d, "tok"))
        t = text.Tokenizer.of(os.path.join(d, "tok"))
        for turns in a.turns:
            convs = [[{"role": r, "content": " ".join(rng.choice(vocab) for _ in range(rng.randint(20, 80)))}
                      for _ in range(turns) for r in ("user", "assistant")] for _ in range(a.conversations)]
            path = os.path.join(d, f"chats{turns}.jsonl")
            with open(path, "w") as f:
                f.writelines(json.dumps({"messages": c}) + "\n" for c in convs)
            corpus = corpus_of(chat.tokenize(path, t, cache_dir=os.path.join(d, "cache"), workers=1,
                                             progress=False)[0])
            starts = np.append(corpus.documents, corpus.length)
            answers = np.asarray(corpus.answers).astype(bool)
            median = int(np.median(np.diff(starts)))
            for L in a.seq_len:
                # the cut: sequence k is tokens [k L, (k+1) L); a token whose conversation started before its
                # sequence's start is trained without that start
                idx = np.arange(corpus.length // L * L)
                doc_start = starts[np.searchsorted(starts, idx, side="right") - 1]
                orphan = answers[idx] & (doc_start < idx // L * L)
                split = int(((starts[:-1] // L) != ((starts[1:] - 1) // L)).sum())
                offsets, _, long = bins(corpus, L)
                n = len(offsets) - 1
                ids, labels, pos = batch_inputs(corpus, seq_len=L, batch=n, step=0, seed=0, packing="docs")
                used = sum(int(min(b - a_, L)) for a_, b in zip(starts[:-1], starts[1:]))
                pad = 1 - used / (n * L)
                print(f"| {2 * turns} | {median:,} | {L:,} | {split:,} of {len(starts) - 1:,} | "
                      f"{int(orphan.sum()):,} of {int(answers[idx].sum()):,} ({100 * orphan.sum() / answers[idx].sum():.1f} %) | "
                      f"{n:,} | {100 * pad:.1f} % | {long:,} |")


if __name__ == "__main__":
    main()

"""Chat data into the token cache: conversations rendered by the chat template, the answers found by rendering each
assistant turn's prefix (autosp/run/chat.py), against the same conversations' text tokenized as plain documents
(autosp/run/text.py). What finding the answers costs beside tokenizing.

    python bench/chat_tokenize.py [--conversations 2000] [--turns 4] [--workers 1]

A word-level BPE trained here (no download) with ChatML's special tokens and template; synthetic conversations of
`--turns` user/assistant pairs of 20 to 80 words each.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer(words: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<eos>", "<unk>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(words, trainers.BpeTrainer(vocab_size=2000, special_tokens=specials, show_progress=False))
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>",
                                  additional_special_tokens=specials[2:])
    out.chat_template = CHATML
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=2000)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--workers", type=int, default=1)
    a = p.parse_args()
    import random

    import numpy as np

    from autosp.run import chat, text
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(3000)]

    def sentence():
        return " ".join(rng.choice(vocab) for _ in range(rng.randint(20, 80)))
    convs = [[{"role": r, "content": sentence()} for _ in range(a.turns) for r in ("user", "assistant")]
             for _ in range(a.conversations)]
    with tempfile.TemporaryDirectory() as d:
        tok = tokenizer(vocab * 3)
        tok.save_pretrained(os.path.join(d, "tok"))
        t = text.Tokenizer.of(os.path.join(d, "tok"))
        with open(os.path.join(d, "chats.jsonl"), "w") as f:
            f.writelines(json.dumps({"messages": c}) + "\n" for c in convs)
        with open(os.path.join(d, "docs.jsonl"), "w") as f:
            f.writelines(json.dumps({"text": tok.apply_chat_template(c, tokenize=False)}) + "\n" for c in convs)
        t0 = time.perf_counter()
        cache, _ = chat.tokenize(os.path.join(d, "chats.jsonl"), t, cache_dir=os.path.join(d, "cache"),
                                 workers=a.workers, progress=False)
        t_chat = time.perf_counter() - t0
        t0 = time.perf_counter()
        plain, _ = text.tokenize(os.path.join(d, "docs.jsonl"), t, cache_dir=os.path.join(d, "cache"),
                                 workers=a.workers, progress=False)
        t_text = time.perf_counter() - t0
        share = float(np.asarray(chat.answers(cache)).mean())
        print(f"{a.conversations} conversations of {2 * a.turns} turns, {cache.meta['tokens']:,} tokens "
              f"({100 * share:.1f} % answers), {a.workers} worker(s):\n"
              f"  chat (render + find the answers): {t_chat:.2f} s, {cache.meta['tokens'] / t_chat:,.0f} tokens/s\n"
              f"  the same text as documents:       {t_text:.2f} s, {plain.meta['tokens'] / t_text:,.0f} tokens/s\n"
              f"  ratio {t_chat / t_text:.1f}x")


if __name__ == "__main__":
    main()

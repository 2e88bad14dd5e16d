"""The assets of README's walkthrough "Extend a model's context", from text that ships with Python.

    python examples/extend_context.py --out demo

writes, in a minute on a CPU:
  demo/llama/          a small Llama (2 layers, hidden 64, 256 positions), saved with save_pretrained, and its
                       tokenizer: a byte-level BPE of 512 tokens trained with `tokenizers` on the documents
  demo/docs.jsonl      the documents to train on, one JSON object per line ({"text": ...}): the help topics of
                       pydoc (Python's own documentation, in `pydoc_data.topics`) and the standard library's
                       module docstrings
  demo/heldout.jsonl   a few of the help topics, kept apart for `autosp eval`

The model is initialised, not pretrained: the walkthrough shows the commands (tokenize, train at 4x its
positions with YaRN, export, evaluate, passkey), not a model worth using.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sysconfig


def documents(quick: bool = False) -> list[str]:
    """pydoc's help topics, then (unless `quick`) the standard library's module docstrings (sorted, each at least
    200 characters)."""
    from pydoc_data.topics import topics
    docs = [topics[k] for k in sorted(topics)]
    if quick:
        return docs
    root = sysconfig.get_paths()["stdlib"]
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in {"site-packages", "test", "tests", "__pycache__", "idlelib"})
        for name in sorted(n for n in names if n.endswith(".py")):
            try:
                with open(os.path.join(d, name), encoding="utf-8") as f:
                    doc = ast.get_docstring(ast.parse(f.read()))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            if doc and len(doc) >= 200:
                docs.append(doc)
    return docs


def tokenizer(docs: list[str], vocab: int = 512):
    """A byte-level BPE trained on the documents, as a transformers fast tokenizer with an EOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="demo")
    p.add_argument("--positions", type=int, default=256, help="the model's max_position_embeddings (default 256)")
    p.add_argument("--quick", action="store_true", help="pydoc's help topics only (the tests' assets)")
    a = p.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    docs = documents(a.quick)
    held = docs[:8]                              # a few help topics, never trained on
    model_dir = os.path.join(a.out, "llama")
    os.makedirs(model_dir, exist_ok=True)
    tok = tokenizer(docs[8:])
    tok.save_pretrained(model_dir)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=a.positions,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    for name, part in (("docs.jsonl", docs[8:]), ("heldout.jsonl", held)):
        with open(os.path.join(a.out, name), "w") as f:
            for d in part:
                f.write(json.dumps({"text": d}) + "\n")
    print(f"{model_dir}: a Llama of {sum(p.numel() for p in LlamaForCausalLM(cfg).parameters()):,} parameters, "
          f"{a.positions} positions, its {len(tok)}-token tokenizer; {os.path.join(a.out, 'docs.jsonl')}: "
          f"{len(docs) - 8} documents ({sum(map(len, docs[8:])):,} characters); "
          f"{os.path.join(a.out, 'heldout.jsonl')}: {len(held)}")


if __name__ == "__main__":
    main()

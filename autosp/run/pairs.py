"""Preference pairs in: rows of `prompt`, `chosen`, `rejected`, rendered, tokenized once into a cache, laid out in
`--seq-len` tokens.

    pairs = tokenize_pairs("prefs.jsonl", Tokenizer.of("models/llama"), seq_len=512)    # a PairCache
    pairs.ids[i]       # int [2, L]: pair i's chosen and rejected sequence, prompt + answer, right-padded
    pairs.labels[i]    # int [2, L]: the ids on the answer's tokens, -100 elsewhere (the model shifts them)

A row is TRL's preference format, JSONL, Parquet or a dataset saved with `datasets`: either three strings, or
`prompt` a list of role/content messages and `chosen`/`rejected` an assistant message or a list of messages
(conversational), rendered with the tokenizer's own chat template. A string pair is the prompt's tokens (after the
tokenizer's BOS, where it has one) followed by the answer's and EOS; a conversation is the template's text of the
prompt with the generation prompt, then the rest of the template's text of the whole conversation, each tokenized
apart so that the answer's tokens start exactly where the prompt's end. A pair longer than `--seq-len` loses the
start of its prompt (both sequences the same tokens, so the answers are scored after the same context): the
banner counts them. An answer that leaves no prompt token is refused.

The cache lives in `cache_dir/pairs-KEY/` (`ids.npy`, `labels.npy`, `meta.json`), KEY a hash of the files (path,
size, modification time), the tokenizer (text.Tokenizer.digest), `--seq-len` and PAIRS_FORMAT; it is written into a
temporary folder and renamed into place, so a bad row (named with its file, row and fix) leaves nothing behind.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from autosp.errors import AutospError
from autosp.run import text
from autosp.run.chat import ROLES

PAIR_FIELDS = ("prompt", "chosen", "rejected")
PAIRS_FORMAT = 1


# ---------------------------------------------------------------- rows

def is_pairs(path: str | None) -> bool:
    """Whether --data's first row (or column set) is a preference pair's: `prompt`, `chosen` and `rejected`."""
    if path is None or not (os.path.isdir(path) or path.endswith(text.TEXT_SUFFIXES)):
        return False
    try:
        source = text.sources(path)[0]
    except AutospError:
        return False
    if os.path.isdir(source):
        from datasets import load_from_disk
        try:
            names = load_from_disk(source).column_names
        except Exception:  # noqa: BLE001 - not a dataset this reads: not pairs
            return False
        return set(PAIR_FIELDS) <= set(names)
    if source.endswith(".parquet"):
        import pyarrow.parquet as pq
        return set(PAIR_FIELDS) <= set(pq.read_schema(source).names)
    try:
        return set(PAIR_FIELDS) <= set(next(rows(source))[1])
    except (StopIteration, AutospError, TypeError):
        return False


def rows(source: str) -> Iterator[tuple[int, dict]]:
    """(row number from 1, row) of one source file or saved dataset."""
    if os.path.isdir(source):
        from datasets import Dataset, load_from_disk
        ds = load_from_disk(source)
        if not isinstance(ds, Dataset):
            raise AutospError(f"--data {source}: a dataset with splits {list(ds)}. Fix: pass one split's folder.")
        yield from enumerate(ds, 1)
    elif source.endswith(".parquet"):
        import pyarrow.parquet as pq
        yield from enumerate(pq.read_table(source).to_pylist(), 1)
    elif source.endswith((".jsonl", ".jsonl.gz")):
        import gzip
        opener = gzip.open if source.endswith(".gz") else open
        with opener(source, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise AutospError(f"--data {source}: line {n} is not JSON ({exc}). Fix: one JSON object per "
                                      "line.") from None
                yield n, row
    else:
        raise AutospError(f"--data {source}: preference pairs are read from .jsonl, .jsonl.gz, .parquet or a saved "
                          "dataset. Fix: convert it to JSONL with prompt, chosen and rejected fields.")


# ---------------------------------------------------------------- rendering

class _Bad(Exception):
    """A row that cannot be rendered: why, and the fix."""


def _messages(value, field: str) -> list[dict]:
    """`value` as a list of role/content messages (an assistant answer may be one message)."""
    msgs = [value] if isinstance(value, dict) else value
    if not isinstance(msgs, list) or not msgs:
        raise _Bad(f"its {field!r} is {type(value).__name__}, not messages", "a list of {\"role\", \"content\"} "
                   "messages, or text in all three fields")
    for m in msgs:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise _Bad(f"its {field!r} holds {m!r}, not a role/content message", "each message "
                       "{\"role\": ..., \"content\": ...}")
        if m["role"] not in ROLES:
            raise _Bad(f"its {field!r} has the unknown role {m['role']!r}", f"roles are {', '.join(ROLES)}")
    if field != "prompt" and msgs[0]["role"] != "assistant":
        raise _Bad(f"its {field!r} starts with a {msgs[0]['role']!r} message, not the assistant's answer",
                   "the answer as {\"role\": \"assistant\", \"content\": ...}")
    return msgs


def render(tok, row) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) of one row; raises _Bad."""
    if not isinstance(row, dict):
        raise _Bad(f"it is a {type(row).__name__}, not an object", "one JSON object per line")
    missing = [f for f in PAIR_FIELDS if row.get(f) is None]
    if missing:
        raise _Bad(f"it has no {', '.join(map(repr, missing))} (it has {', '.join(map(repr, row))})",
                   "every row needs prompt, chosen and rejected")
    if row["chosen"] == row["rejected"]:
        raise _Bad("its chosen and rejected answers are the same", "drop the row: it prefers nothing")

    def encode(s: str) -> list[int]:
        return list(tok(s, add_special_tokens=False)["input_ids"])

    if all(isinstance(row[f], str) for f in PAIR_FIELDS):
        bos = [] if getattr(tok, "bos_token_id", None) is None else [int(tok.bos_token_id)]
        eos = [int(tok.eos_token_id)]
        return bos + encode(row["prompt"]), encode(row["chosen"]) + eos, encode(row["rejected"]) + eos
    if any(isinstance(row[f], str) for f in PAIR_FIELDS):
        kinds = ", ".join(f"{f} {type(row[f]).__name__}" for f in PAIR_FIELDS)
        raise _Bad(f"it mixes text and messages ({kinds})", "all three fields text, or all messages")
    prompt = _messages(row["prompt"], "prompt")
    try:
        head = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        whole = [tok.apply_chat_template(prompt + _messages(row[f], f), tokenize=False) for f in ("chosen", "rejected")]
    except _Bad:
        raise
    except Exception as exc:  # noqa: BLE001 - the template is the user's
        raise _Bad(f"the tokenizer's chat template raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                   "a tokenizer whose chat_template renders these messages (tokenizer.chat_template)") from None
    answers = []
    for f, full in zip(("chosen", "rejected"), whole):
        if not full.startswith(head):
            raise _Bad(f"the chat template's text of the conversation with {f!r} does not start with its text of "
                       "the prompt", "a chat template that renders a conversation as its prompt followed by the answer")
        answers.append(encode(full[len(head):]))
    return encode(head), answers[0], answers[1]


def layout(prompt: list[int], answer: list[int], seq_len: int, pad: int, keep: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(ids, labels, cut) of one sequence in seq_len tokens: the prompt (its start cut to its last `keep` tokens:
    the room the pair's longer answer leaves), the answer, padding; labels the answer's ids, -100 elsewhere."""
    cut = len(prompt) > keep
    prompt = prompt[len(prompt) - keep:] if cut else prompt
    ids = np.full(seq_len, pad, dtype=np.int64)
    labels = np.full(seq_len, -100, dtype=np.int64)
    n = len(prompt)
    ids[:n] = prompt
    ids[n:n + len(answer)] = answer
    labels[n:n + len(answer)] = answer
    return ids, labels, cut


# ---------------------------------------------------------------- the cache

@dataclass(frozen=True)
class PairCache:
    """Tokenized pairs on disk (see the module docstring)."""
    folder: str
    meta: dict

    @property
    def ids(self) -> np.ndarray:
        return np.load(os.path.join(self.folder, "ids.npy"), mmap_mode="r")

    @property
    def labels(self) -> np.ndarray:
        return np.load(os.path.join(self.folder, "labels.npy"), mmap_mode="r")

    @property
    def pairs(self) -> int:
        return int(self.meta["pairs"])

    @property
    def name(self) -> str:
        s = self.meta["sources"]
        return (f"{', '.join(s[:3])}{' ...' if len(s) > 3 else ''} ({self.pairs:,} preference pairs, "
                f"{self.meta['kind']})")

    @property
    def key(self) -> str:
        return os.path.basename(self.folder)


def cache_key(path: str, tokenizer: text.Tokenizer, seq_len: int) -> str:
    h = hashlib.sha256(text.cache_key(path, tokenizer, "\0".join(PAIR_FIELDS)).encode())
    h.update(f"\0seq_len {seq_len}\0autosp pairs {PAIRS_FORMAT}".encode())
    return "pairs-" + h.hexdigest()[:24]


def find(path: str, tokenizer: text.Tokenizer, seq_len: int, cache_dir: str | None = None) -> PairCache | None:
    folder = os.path.join(cache_dir or text.default_cache_dir(), cache_key(path, tokenizer, seq_len))
    meta = os.path.join(folder, "meta.json")
    if not os.path.isfile(meta):
        return None
    with open(meta) as f:
        return PairCache(folder, json.load(f))


def tokenize_pairs(path: str, tokenizer: text.Tokenizer, *, seq_len: int,
                   cache_dir: str | None = None) -> tuple[PairCache, bool]:
    """(the cache of `--data PATH`'s pairs at `seq_len`, whether it was there already). A bad row raises
    AutospError naming the file, the row and the fix, with nothing written."""
    found = find(path, tokenizer, seq_len, cache_dir)
    if found is not None:
        return found, True
    tok = tokenizer.load()
    if getattr(tok, "eos_token_id", None) is None:
        raise AutospError(f"--tokenizer {tokenizer.path}: it has no EOS token, which ends each answer. Fix: a "
                          "tokenizer with an eos_token.")
    if hasattr(tok, "model_max_length"):
        tok.model_max_length = 1 << 62
    pad = tok.pad_token_id if getattr(tok, "pad_token_id", None) is not None else tok.eos_token_id
    ids, labels, cut, kinds = [], [], 0, set()
    for source in text.sources(path):
        for n, row in rows(source):
            where = f"--data {source}: {'line' if source.endswith(('.jsonl', '.gz')) else 'row'} {n}"
            try:
                prompt, chosen, rejected = render(tok, row)
            except _Bad as bad:
                why, fix = bad.args
                raise AutospError(f"{where}: {why}. Fix: {fix}.") from None
            kinds.add("text" if isinstance(row["prompt"], str) else "conversations")
            longest = max(len(chosen), len(rejected))
            if longest >= seq_len:
                raise AutospError(f"{where}: its answer is {longest} tokens, and --seq-len {seq_len} leaves no "
                                  f"prompt token before it. Fix: --seq-len {_up(longest + len(prompt))} or more, "
                                  "or a shorter answer.")
            pair = [layout(prompt, a, seq_len, pad, seq_len - longest) for a in (chosen, rejected)]
            ids.append(np.stack([p[0] for p in pair]))
            labels.append(np.stack([p[1] for p in pair]))
            cut += any(p[2] for p in pair)
    if not ids:
        raise AutospError(f"--data {path}: no preference pairs. Fix: rows with prompt, chosen and rejected.")
    root = cache_dir or text.default_cache_dir()
    key = cache_key(path, tokenizer, seq_len)
    with text.staged(root, key) as tmp:
        dtype = np.int32
        np.save(os.path.join(tmp, "ids.npy"), np.stack(ids).astype(dtype))
        np.save(os.path.join(tmp, "labels.npy"), np.stack(labels).astype(dtype))
        meta = {"pairs": len(ids), "cut": cut, "seq_len": seq_len, "kind": " and ".join(sorted(kinds)),
                "tokenizer": tokenizer.path, "vocab": len(tok), "sources": text.sources(path), "format": PAIRS_FORMAT}
        return PairCache(text.publish(tmp, root, key, meta), meta), False


def _up(n: int) -> int:
    """n rounded up to a multiple of 64."""
    return -(-n // 64) * 64


# ---------------------------------------------------------------- batches

def pair_ids(pairs: int, batch: int, step: int, seed: int) -> list[int]:
    """The pair indices of global step `step` (0-based), in row order: a fresh permutation per epoch, drawn from
    the seed and the epoch only (data.sequence_ids' order, over pairs)."""
    from autosp.run.data import _order
    return [int(_order(pairs, seed, (step * batch + j) // pairs)[(step * batch + j) % pairs]) for j in range(batch)]


def pair_batch(cache: PairCache, *, batch: int, step: int, seed: int, part: tuple[int, int] = (0, 1)):
    """(pair indices, ids, labels) of dp rank part[0]'s rows of step `step`: ids and labels int64 [2 k, L], the k
    chosen sequences first, then the k rejected ones in the same order."""
    r, d = part
    return rows_batch(cache, pair_ids(cache.pairs, batch, step, seed)[r * batch // d:(r + 1) * batch // d])


def rows_batch(cache: PairCache, rows: list[int]):
    """(rows, ids, labels) of these pairs, laid out as pair_batch lays them out."""
    def flat(x):                                                        # [k, 2, L] -> [2 k, L]
        return np.ascontiguousarray(x.transpose(1, 0, 2).reshape(-1, x.shape[-1])).astype(np.int64)
    return rows, flat(cache.ids[rows]), flat(cache.labels[rows])

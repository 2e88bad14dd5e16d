"""Training data: a token stream cut into sequences, served in an order fixed by (seed, step).

    corpus = open_corpus(None)                 # the Python standard library's source, as bytes
    corpus = open_corpus("tokens.npy")         # or .bin (--token-dtype uint16|uint32)
    corpus = open_corpus("docs.jsonl", tokenizer=Tokenizer.of("model"))    # text: tokenized once (text.py)
    ids = batch_for_step(corpus, seq_len=512, batch=8, step=3, seed=0, part=(0, 2))
    ids, labels, positions = batch_inputs(corpus, seq_len=512, batch=8, step=3, seed=0, packing="docs")

The default corpus is every `*.py` file under `sysconfig.get_paths()["stdlib"]` (site-packages
excluded), in sorted path order, concatenated: every machine with the same Python has it, and a
loss curve on it means something. Sequence k is tokens [k L, (k+1) L) of the stream; the order of
sequences is a fresh permutation per epoch, drawn from the seed and the epoch only, so the batch of
a step never depends on how many ranks read it: dp rank r of D takes rows [r B/D, (r+1) B/D).

Text (text.py) comes with the start of every document: documents are separated by the tokenizer's EOS in the
stream, and a sequence may hold several. `packing="docs"` gives each token its position in its document (the
position ids restart where a document starts, so the model's attention stays inside each document: autosp's
packed-documents path, exact and O(s)) and does not ask the first token of a document to be predicted from the
one before (its label is -100). A document longer than a sequence is cut: each piece starts at position 0 in the
sequence that holds it, as a document of its own. `packing="concat"`: one causal sequence over the stream.

Chat data (chat.py) is not cut: each sequence holds whole conversations (packed best-fit decreasing), then padding
(the EOS, label -100); a conversation longer than a sequence keeps its last `seq_len` tokens (bins). An
answer is never trained without its question (but for the start of a conversation longer than a sequence).
"""
from __future__ import annotations

import bisect
import os
import sys
import sysconfig
from dataclasses import dataclass, field, replace

import numpy as np

from autosp.errors import AutospError

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class Corpus:
    """A read-only token stream: `tokens(lo, hi)` without loading the whole of it."""
    name: str
    length: int                                  # tokens
    max_token: int | None                        # largest token id, when known without a full scan
    _array: np.ndarray | None = None             # memory-mapped file, or None (stdlib files)
    _files: list[str] = field(default_factory=list)
    _starts: list[int] = field(default_factory=list)
    documents: np.ndarray | None = None          # the stream index where each document starts (text), sorted
    eos: int | None = None                       # the token that ends each document
    offset: int = 0                              # where this corpus starts in the stream it reads (a part of one)
    answers: np.ndarray | None = None            # chat data (chat.py): uint8 per stream token, 1 on answer tokens;
                                                 # set, every other token's label is -100 (--loss-on assistant)
    conversations: bool = False                  # chat data: each sequence holds whole conversations (bins)

    def tokens(self, lo: int, hi: int) -> np.ndarray:
        lo, hi = lo + self.offset, hi + self.offset
        if self._array is not None:
            return np.asarray(self._array[lo:hi], dtype=np.int64)
        out = bytearray()
        i = bisect.bisect_right(self._starts, lo) - 1
        while len(out) < hi - lo and i < len(self._files):
            with open(self._files[i], "rb") as f:
                f.seek(lo + len(out) - self._starts[i])
                out += f.read(hi - lo - len(out))
            i += 1
        return np.frombuffer(bytes(out), dtype=np.uint8).astype(np.int64)

    def sequences(self, seq_len: int) -> int:
        if self.whole_documents:
            return len(bins(self, seq_len)[0]) - 1
        return self.length // seq_len

    @property
    def whole_documents(self) -> bool:
        """Chat data: each sequence holds whole conversations (bins), not a cut of the stream."""
        return self.conversations and self.documents is not None

    def part(self, lo: int, hi: int, name: str) -> Corpus:
        """Tokens [lo, hi) as a corpus of their own (a held-out part): its documents start where they did, and at
        lo (a document cut there starts anew)."""
        docs = None
        if self.documents is not None:
            inside = self.documents[(self.documents > lo) & (self.documents < hi)] - lo
            docs = np.concatenate([[0], inside]).astype(np.int64)
        return replace(self, name=name, length=hi - lo, documents=docs, offset=self.offset + lo)


def stdlib_corpus() -> Corpus:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
        files += [os.path.join(d, n) for n in names if n.endswith(".py")]
    files.sort(key=lambda p: os.path.relpath(p, root))
    starts, total = [], 0
    for p in files:
        starts.append(total)
        total += os.path.getsize(p)
    v = sys.version_info
    return Corpus(f"the Python {v.major}.{v.minor} standard library's source ({len(files)} files, {root})",
                  total, 255, _files=files, _starts=starts)


def open_corpus(path: str | None, dtype: str = "uint16", *, tokenizer=None, text_field: str = "text",
                cache_dir: str | None = None) -> Corpus:
    """The default corpus (None), a .npy token array, a raw .bin of `dtype` tokens, or text (text.py's files,
    folders and saved datasets) tokenized by `tokenizer` (a text.Tokenizer) into its cache, opened without
    tokenizing again when the cache is there; without a tokenizer, any other file is bytes."""
    from autosp.run import text
    if path is None:
        return stdlib_corpus()
    if os.path.isdir(path) or path.endswith(text.TEXT_SUFFIXES):
        if tokenizer is None:
            raise AutospError(f"--data {path}: text, and the model has no tokenizer. Fix: --tokenizer FOLDER (a "
                              "saved Hugging Face tokenizer), or a model folder that holds its tokenizer's files.")
        cache = text.find(path, tokenizer, text_field, cache_dir)
        if cache is None:
            raise AutospError(f"--data {path}: not tokenized yet. Fix: autosp train tokenizes it before the ranks "
                              "start (text.tokenize).")
        return corpus_of(cache)
    if not os.path.isfile(path):
        raise AutospError(f"--data {path}: no such file. Fix: pass an existing .npy / .bin token file, a text file "
                          "(.txt, .jsonl, .jsonl.gz, .parquet), a folder of them or a saved dataset, or leave --data "
                          "out to train on the Python standard library's source.")
    if path.endswith(".npy"):
        try:
            arr = np.load(path, mmap_mode="r")
        except Exception as exc:  # noqa: BLE001 - a damaged file is the user's input
            raise AutospError(f"--data {path}: numpy cannot read it ({exc}). Fix: save the tokens with "
                              "numpy.save(path, tokens) as one 1-D integer array.") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise AutospError(f"--data {path}: holds a {arr.dtype} array of shape {arr.shape}; tokens must be a "
                              "1-D integer array. Fix: numpy.save(path, tokens.reshape(-1).astype(np.uint32)).")
        name = f"{path} ({arr.dtype} tokens)"
    elif path.endswith(".bin"):
        if dtype not in ("uint16", "uint32"):
            raise AutospError(f"--token-dtype {dtype}: a .bin token file is uint16 or uint32. Fix: --token-dtype "
                              "uint16 (vocabularies up to 65536) or --token-dtype uint32.")
        size = os.path.getsize(path)
        item = np.dtype(dtype).itemsize
        if size % item:
            raise AutospError(f"--data {path}: {size} bytes is not a whole number of {dtype} tokens. Fix: pass the "
                              f"--token-dtype it was written with (uint16 or uint32).")
        arr = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
        name = f"{path} ({dtype} tokens)"
    else:
        size = os.path.getsize(path)
        arr = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        name = f"{path} (bytes)"
    if len(arr) and np.issubdtype(arr.dtype, np.signedinteger) and int(arr.min()) < 0:
        raise AutospError(f"--data {path}: holds negative token ids (min {int(arr.min())}). Fix: tokens are "
                          "ids in [0, vocab).")
    top = int(arr.max()) if len(arr) else None
    return Corpus(name, len(arr), top, _array=arr)


def corpus_of(cache) -> Corpus:
    """The corpus of a text.TokenCache: its tokens and where each document starts."""
    meta = cache.meta
    answers = None
    if meta.get("chat"):
        from autosp.run.chat import answers as answers_of
        answers = answers_of(cache)
    what = "conversations rendered by the chat template of" if answers is not None else "documents tokenized by"
    return Corpus(f"{', '.join(meta['sources'][:3])}{' ...' if len(meta['sources']) > 3 else ''} ({meta['documents']:,} "
                  f"{what} {os.path.basename(meta['tokenizer'])})", meta["tokens"], meta["vocab"] - 1,
                  _array=cache.tokens, documents=np.asarray(cache.starts), eos=meta["eos"], answers=answers,
                  conversations=answers is not None)


_BINS: dict = {}


def bins(corpus: Corpus, seq_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Chat data's sequences: (offsets, members, how many conversations were longer than a sequence): sequence k
    holds the conversations members[offsets[k]:offsets[k + 1]], whole, then padding. Packed best-fit decreasing
    (the longest first, each into the fullest sequence it still fits: TRL's packing's strategy), so the padding is
    what the lengths leave, not what the data's order does (in order, 39 % of the tokens were padding for
    2,466-token conversations in 4,096-token sequences; bench/chat_packing.py). A conversation longer than a sequence
    has one to itself and keeps its last `seq_len` tokens (the final question and its answer: what people fine-tune
    at long context is long documents, then a question, with the loss on the answer, which keeping the start would
    drop whole; a preference pair loses the start of its prompt alike, pairs.py). Cutting the stream at fixed
    strides instead trained the answers of every conversation that crossed a sequence's end without its start."""
    key = (corpus.name, corpus.offset, corpus.length, len(corpus.documents), seq_len)
    hit = _BINS.get(key)
    if hit is None:
        starts = np.asarray(corpus.documents, dtype=np.int64)
        whole = np.diff(np.append(starts, corpus.length))
        sizes = np.minimum(whole, seq_len)
        order = np.lexsort((np.arange(len(sizes)), -sizes))        # the longest first; ties in the data's order
        caps: list[int] = []                        # the distinct room left in some sequence, sorted
        room: dict[int, list[int]] = {}             # room left -> the sequences with that much (the last made last)
        content: list[list[int]] = []
        for d in order.tolist():
            n = int(sizes[d])
            at = bisect.bisect_left(caps, n)
            if at < len(caps):                      # the fullest sequence it fits in
                c = caps[at]
                k = room[c].pop()
                if not room[c]:
                    del room[c]
                    caps.pop(at)
            else:
                c, k = seq_len, len(content)
                content.append([])
            content[k].append(d)
            left = c - n
            if left > 0:
                if left not in room:
                    bisect.insort(caps, left)
                    room[left] = []
                room[left].append(k)
        offsets = np.zeros(len(content) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(c) for c in content])
        members = np.asarray([d for c in content for d in c], dtype=np.int64)
        hit = (offsets, members, int((whole > seq_len).sum()))
        _BINS.clear()
        _BINS[key] = hit
    return hit


def _binned(corpus: Corpus, rows: list[int], seq_len: int, packing: str):
    """(ids, labels, positions or None) of chat data's sequences `rows` (bins): each conversation whole (or its
    last seq_len tokens), the labels its answer tokens' (every other token's -100; all its tokens' with --loss-on
    all; the first of each conversation -100 with packed documents), then padding to seq_len (the EOS, label -100;
    with packed documents a document of its own, positions from 0)."""
    offsets, members, _ = bins(corpus, seq_len)
    starts = np.append(np.asarray(corpus.documents, dtype=np.int64), corpus.length)
    ids = np.full((len(rows), seq_len), corpus.eos if corpus.eos is not None else 0, dtype=np.int64)
    labels = np.full((len(rows), seq_len), -100, dtype=np.int64)
    positions = np.zeros((len(rows), seq_len), dtype=np.int64)
    o = corpus.offset
    for r, k in enumerate(rows):
        at = 0
        for d in members[offsets[k]:offsets[k + 1]].tolist():
            lo = max(int(starts[d]), int(starts[d + 1]) - seq_len)      # longer than a sequence: its last seq_len
            n = int(starts[d + 1]) - lo
            ids[r, at:at + n] = corpus.tokens(lo, lo + n)
            if corpus.answers is None:                  # --loss-on all
                labels[r, at:at + n] = ids[r, at:at + n]
            else:
                keep = np.asarray(corpus.answers[o + lo:o + lo + n]).astype(bool)
                labels[r, at:at + n] = np.where(keep, ids[r, at:at + n], -100)
            if packing == "docs" and at > 0:
                labels[r, at] = -100
            positions[r, at:at + n] = np.arange(n)
            at += n
        positions[r, at:] = np.arange(seq_len - at)
    return ids, labels, (positions if packing == "docs" else None)


def check_corpus(corpus: Corpus, seq_len: int, vocab: int) -> None:
    """Errors a run would otherwise meet mid-way: too little data, ids beyond the vocabulary."""
    if corpus.sequences(seq_len) < 1:
        raise AutospError(f"data: {corpus.name} has {corpus.length} tokens, fewer than one sequence of "
                          f"--seq-len {seq_len}. Fix: a shorter --seq-len or a larger --data file.")
    if corpus.max_token is not None and corpus.max_token >= vocab:
        raise AutospError(f"data: {corpus.name} has token ids up to {corpus.max_token}, but the model's vocabulary "
                          f"has {vocab}. Fix: a model whose vocab_size is at least {corpus.max_token + 1} "
                          "(a config.json with that vocab_size), or data tokenized for this model.")


_PERMS: dict = {}


def _order(n: int, seed: int, epoch: int) -> np.ndarray:
    key = (n, seed, epoch)
    hit = _PERMS.get(key)
    if hit is None:
        hit = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n)
        _PERMS.clear()
        _PERMS[key] = hit
    return hit


def sequence_ids(corpus: Corpus, seq_len: int, batch: int, step: int, seed: int) -> list[int]:
    """The indices of the `batch` sequences of global step `step` (0-based), in row order."""
    n = corpus.sequences(seq_len)
    out = []
    for j in range(batch):
        i = step * batch + j
        out.append(int(_order(n, seed, i // n)[i % n]))
    return out


def batch_for_step(corpus: Corpus, *, seq_len: int, batch: int, step: int, seed: int,
                   part: tuple[int, int] = (0, 1)) -> np.ndarray:
    """Rows of step `step`'s global batch that dp rank part[0] of part[1] trains on: int64 [batch/D, L]."""
    r, d = part
    rows = sequence_ids(corpus, seq_len, batch, step, seed)[r * batch // d:(r + 1) * batch // d]
    if corpus.whole_documents:
        return _binned(corpus, rows, seq_len, "concat")[0]
    return np.stack([corpus.tokens(k * seq_len, (k + 1) * seq_len) for k in rows])


def batch_inputs(corpus: Corpus, *, seq_len: int, batch: int, step: int, seed: int, part: tuple[int, int] = (0, 1),
                 packing: str = "concat") -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(token ids, labels, position ids or None) of the rows batch_for_step gives, packed as `packing` says (the
    module docstring): int64 [rows, L] each; labels are the ids (the model shifts them) with -100 where a document
    starts inside a sequence."""
    r, d = part
    rows = sequence_ids(corpus, seq_len, batch, step, seed)[r * batch // d:(r + 1) * batch // d]
    if corpus.whole_documents:
        return _binned(corpus, rows, seq_len, packing)
    ids = np.stack([corpus.tokens(k * seq_len, (k + 1) * seq_len) for k in rows])
    if packing != "docs" or corpus.documents is None:
        return ids, _answers_only(corpus, rows, seq_len, ids), None
    idx = np.asarray(rows, dtype=np.int64)[:, None] * seq_len + np.arange(seq_len)[None, :]   # stream indices
    doc = np.searchsorted(corpus.documents, idx, side="right") - 1
    first = corpus.documents[doc]
    start = np.maximum(first, idx[:, :1])                    # a document cut by the sequence starts where it does
    positions = idx - start
    labels = ids.copy()
    labels[(idx == first) & (positions == 0) & (idx > idx[:, :1])] = -100
    return ids, _answers_only(corpus, rows, seq_len, labels), positions


def _answers_only(corpus: Corpus, rows: list[int], seq_len: int, labels: np.ndarray) -> np.ndarray:
    """The labels with -100 on every token that is not an answer's, where the corpus has answers (chat data)."""
    if corpus.answers is None:
        return labels
    o = corpus.offset
    keep = np.stack([np.asarray(corpus.answers[o + k * seq_len:o + (k + 1) * seq_len]) for k in rows]).astype(bool)
    return np.where(keep, labels, -100)

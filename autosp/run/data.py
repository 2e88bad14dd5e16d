"""Training data: a token stream cut into sequences, served in an order fixed by (seed, step).

    corpus = open_corpus(None)                 # the Python standard library's source, as bytes
    corpus = open_corpus("tokens.npy")         # or .bin (--dtype uint16|uint32), or any text file
    ids = batch_for_step(corpus, seq_len=512, batch=8, step=3, seed=0, part=(0, 2))

The default corpus is every `*.py` file under `sysconfig.get_paths()["stdlib"]` (site-packages
excluded), in sorted path order, concatenated: every machine with the same Python has it, and a
loss curve on it means something. Sequence k is tokens [k L, (k+1) L) of the stream; the order of
sequences is a fresh permutation per epoch, drawn from the seed and the epoch only, so the batch of
a step never depends on how many ranks read it: dp rank r of D takes rows [r B/D, (r+1) B/D).
"""
from __future__ import annotations

import bisect
import os
import sys
import sysconfig
from dataclasses import dataclass, field

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

    def tokens(self, lo: int, hi: int) -> np.ndarray:
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
        return self.length // seq_len


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


def open_corpus(path: str | None, dtype: str = "uint16") -> Corpus:
    """The default corpus (None), a .npy token array, a raw .bin of `dtype` tokens, or any file as bytes."""
    if path is None:
        return stdlib_corpus()
    if not os.path.isfile(path):
        raise AutospError(f"--data {path}: no such file. Fix: pass an existing .npy / .bin token file or a text "
                          "file, or leave --data out to train on the Python standard library's source.")
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
            raise AutospError(f"--dtype {dtype}: a .bin token file is uint16 or uint32. Fix: --dtype uint16 "
                              "(vocabularies up to 65536) or --dtype uint32.")
        size = os.path.getsize(path)
        item = np.dtype(dtype).itemsize
        if size % item:
            raise AutospError(f"--data {path}: {size} bytes is not a whole number of {dtype} tokens. Fix: pass the "
                              f"--dtype it was written with (uint16 or uint32).")
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
    return np.stack([corpus.tokens(k * seq_len, (k + 1) * seq_len) for k in rows])

"""Text in: documents read from text files, JSONL, Parquet, a folder of these or a dataset saved with
`datasets`, tokenized once by worker processes into a token cache with document boundaries.

    docs = documents("corpus.jsonl", text_field="text")      # the documents, checked as they are read
    cache = tokenize("corpus.jsonl", Tokenizer.of("models/llama"), cache_dir="~/.cache/autosp/tokens")
    cache.tokens, cache.starts                                 # a memory-mapped token array, document starts

A document is a file of a `.txt`, a JSONL line's `text_field`, a Parquet row's column, a dataset row's column.
Each is tokenized without special tokens and followed by the tokenizer's EOS, so documents are separated in the
stream and the packing (data.py) knows where each starts. The cache lives in `cache_dir/KEY/` (`tokens.bin`,
`starts.npy`, `meta.json`), KEY a hash of everything the tokens depend on: the input files (path, size,
modification time), the text field, the tokenizer (all its saved files, its config too: `add_prefix_space` in
tokenizer_config.json changes the ids while tokenizer.json stays the same), the transformers and tokenizers
versions that load and run it, and CACHE_FORMAT. A second run with the same inputs opens it without reading a
document. It is written to a temporary folder and renamed into place, so a cache that exists is whole; a bad line
found while reading leaves nothing behind. Text is UTF-8: other bytes are an error naming the file and the byte,
never replaced in silence. The byte-level presets keep bytes: each document's UTF-8 bytes, separated by byte 0.
"""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from autosp.errors import AutospError

TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
TOKEN_SUFFIXES = (".npy", ".bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "vocab.txt",
                    "merges.txt", "tokenizer.model", "added_tokens.json")
_BATCH_BYTES = 1 << 20                 # documents handed to a worker at a time, about this many bytes
# The cache's layout and what its tokens mean (no special tokens, EOS after each document): a change to either
# bumps it, so that no cache written by the code before is read as this code's.
CACHE_FORMAT = 2


# ---------------------------------------------------------------- the tokenizer

@dataclass(frozen=True)
class Tokenizer:
    """A tokenizer as workers rebuild it: "bytes" (UTF-8 bytes, EOS byte 0) or a folder with a Hugging Face fast
    tokenizer's files."""
    path: str                          # "bytes" or a folder

    @classmethod
    def of(cls, path: str) -> Tokenizer:
        if path == "bytes":
            return cls("bytes")
        if not os.path.isdir(path) or not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
            raise AutospError(f"--tokenizer {path}: not a folder with a tokenizer's files ({', '.join(_TOKENIZER_FILES[:3])}"
                              ", ...). Fix: pass the folder a tokenizer was saved to (tokenizer.save_pretrained), or "
                              "a model folder that has one.")
        return cls(os.path.abspath(path))

    def load(self):
        if self.path == "bytes":
            return _Bytes()
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(self.path, local_files_only=True, use_fast=True)
        except Exception as exc:  # noqa: BLE001 - any failure is the user's files
            raise AutospError(f"--tokenizer {self.path}: transformers cannot load it ({type(exc).__name__}: {exc}). "
                              "Fix: a folder written by a fast tokenizer's save_pretrained.") from None

    def digest(self) -> str:
        """What identifies the tokenizer's ids: every file it was saved as (the JSON ones as JSON, so a copy saved
        again is the same tokenizer), its config included (transformers applies tokenizer_config.json's
        `add_prefix_space` and special tokens to the definition in tokenizer.json when it loads), and the versions
        of the libraries that load and run it. Read from the files, not from a loaded tokenizer: every rank asks,
        and loading one takes seconds."""
        h = hashlib.sha256(self.path.encode() if self.path == "bytes" else b"")
        if self.path == "bytes":
            return h.hexdigest()
        h.update(library_versions().encode())
        for name in _TOKENIZER_FILES:
            file = os.path.join(self.path, name)
            if not os.path.isfile(file):
                continue
            with open(file, "rb") as f:
                data = f.read()
            if name.endswith(".json"):
                try:
                    parsed = json.loads(data)
                    if isinstance(parsed, dict):    # how it was loaded, which save_pretrained writes back, is no id
                        parsed = {k: v for k, v in parsed.items() if k not in _LOADING_KEYS}
                    data = json.dumps(parsed, sort_keys=True).encode()
                except ValueError:       # transformers refuses it when it loads: the bytes identify it until then
                    pass
            h.update(f"\0{name}\0{len(data)}\0".encode())
            h.update(data)
        return h.hexdigest()

    def vocab_and_eos(self) -> tuple[int, int]:
        """(the number of token ids it can produce, its EOS id)."""
        tok = self.load()
        if isinstance(tok, _Bytes):
            return 256, 0
        if tok.eos_token_id is None:
            raise AutospError(f"--tokenizer {self.path}: it has no EOS token, which separates the documents. Fix: "
                              "a tokenizer with an eos_token (set tokenizer.eos_token and save it again).")
        return len(tok), int(tok.eos_token_id)


# keys transformers' save_pretrained writes into tokenizer_config.json about how the tokenizer was loaded (a copy of
# a local folder gains is_local and local_files_only): they change no id
_LOADING_KEYS = frozenset({"is_local", "local_files_only", "name_or_path", "_commit_hash", "cache_dir", "revision",
                           "force_download", "token", "subfolder", "_from_auto", "trust_remote_code"})


def library_versions() -> str:
    """The versions of transformers and tokenizers: the same files may tokenize otherwise under another version."""
    from importlib.metadata import PackageNotFoundError, version
    found = []
    for name in ("transformers", "tokenizers"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} absent")
    return ", ".join(found)


class _Bytes:
    """The byte-level presets' tokenizer: a document's UTF-8 bytes."""

    eos_token_id = 0

    def __call__(self, texts, **_):
        return {"input_ids": [list(t.encode("utf-8")) for t in texts]}

    def __len__(self):
        return 256


# ---------------------------------------------------------------- documents

def sources(path: str) -> list[str]:
    """The files `--data PATH` names, in the order their documents are read; a saved dataset is one source."""
    if os.path.isdir(path):
        if _is_saved_dataset(path):
            return [path]
        found = []
        for d, dirs, names in os.walk(path):
            dirs.sort()
            found += [os.path.join(d, n) for n in sorted(names) if n.endswith(TEXT_SUFFIXES)]
        if not found:
            raise AutospError(f"--data {path}: the folder holds no {', '.join(TEXT_SUFFIXES)} file and is not a dataset "
                              "saved with datasets' save_to_disk. Fix: point --data at the files or the saved dataset.")
        return found
    if not os.path.isfile(path):
        raise AutospError(f"--data {path}: no such file or folder. Fix: pass an existing file (.txt, .jsonl, .jsonl.gz, "
                          ".parquet, .npy, .bin), a folder of them, or a dataset saved with save_to_disk.")
    return [path]


def _is_saved_dataset(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json"))


def documents(path: str, text_field: str = "text") -> Iterator[str]:
    """Every document of `--data PATH`, in order, each checked as it is read (AutospError names the file and line)."""
    for source in sources(path):
        yield from _read(source, text_field)


def _read(source: str, field: str) -> Iterator[str]:
    if os.path.isdir(source):
        yield from _dataset(source, field)
    elif source.endswith(".txt"):
        with open(source, "rb") as f:
            data = f.read()
        try:
            yield data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise AutospError(f"--data {source}: not UTF-8 text: byte {exc.start:,} is {data[exc.start]:#04x} "
                              f"({exc.reason}). Fix: convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8 "
                              f"{source} > {source[:-4]}.utf8.txt), or remove it from --data.") from None
    elif source.endswith((".jsonl", ".jsonl.gz")):
        opener = gzip.open if source.endswith(".gz") else open
        with opener(source, "rb") as f:      # bytes, decoded line by line: a bad byte is named by its line
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise AutospError(f"--data {source}: line {n} is not UTF-8 text: its byte {exc.start:,} is "
                                      f"{raw[exc.start]:#04x} ({exc.reason}). Fix: write the file as UTF-8 (json.dumps"
                                      " escapes any text as ASCII), or convert it (iconv -t utf-8).") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise AutospError(f"--data {source}: line {n} is not JSON ({exc}). Fix: one JSON object per line."
                                      ) from None
                if not isinstance(row, dict) or field not in row:
                    keys = ", ".join(map(repr, row)) if isinstance(row, dict) else type(row).__name__
                    raise AutospError(f"--data {source}: line {n} has no field {field!r} (it has {keys}). Fix: "
                                      "--text-field with the field that holds the text.")
                if not isinstance(row[field], str):
                    raise AutospError(f"--data {source}: line {n}'s {field!r} is a {type(row[field]).__name__}, not "
                                      "text. Fix: --text-field with the field that holds the text.")
                yield row[field]
    elif source.endswith(".parquet"):
        import pyarrow.parquet as pq
        schema = pq.read_schema(source)
        if field not in schema.names:
            raise AutospError(f"--data {source}: no column {field!r} (columns: {', '.join(schema.names)}). Fix: "
                              "--text-field with the column that holds the text.")
        for batch in pq.ParquetFile(source).iter_batches(columns=[field], batch_size=1024):
            yield from (t for t in batch.column(0).to_pylist() if t is not None)
    else:
        raise AutospError(f"--data {source}: not a text file this reads ({', '.join(TEXT_SUFFIXES)}). Fix: convert it, "
                          "or pass tokens (.npy, .bin).")


def _dataset(path: str, field: str) -> Iterator[str]:
    from datasets import Dataset, load_from_disk
    ds = load_from_disk(path)
    if not isinstance(ds, Dataset):
        raise AutospError(f"--data {path}: a dataset with splits {list(ds)}. Fix: pass one split's folder "
                          f"(e.g. {os.path.join(path, next(iter(ds)))}).")
    if field not in ds.column_names:
        raise AutospError(f"--data {path}: the dataset has no column {field!r} (columns: {', '.join(ds.column_names)})."
                          " Fix: --text-field with the column that holds the text.")
    for batch in ds.select_columns([field]).iter(batch_size=1024):
        yield from (t for t in batch[field] if t is not None)


# ---------------------------------------------------------------- the cache

@dataclass(frozen=True)
class TokenCache:
    """A tokenized corpus on disk: tokens (memory-mapped), the start of every document, and what made it."""
    folder: str
    meta: dict

    @property
    def tokens(self) -> np.ndarray:
        return np.memmap(os.path.join(self.folder, "tokens.bin"), dtype=self.meta["dtype"], mode="r",
                         shape=(self.meta["tokens"],))

    @property
    def starts(self) -> np.ndarray:
        return np.load(os.path.join(self.folder, "starts.npy"), mmap_mode="r")


def cache_key(path: str, tokenizer: Tokenizer, text_field: str) -> str:
    h = hashlib.sha256()
    for source in sources(path):
        if os.path.isdir(source):                       # a saved dataset: every file in it
            files = sorted(os.path.join(d, n) for d, _, ns in os.walk(source) for n in ns)
        else:
            files = [source]
        for file in files:
            st = os.stat(file)
            h.update(f"{os.path.abspath(file)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    h.update(tokenizer.digest().encode())
    h.update(text_field.encode())
    h.update(f"\0autosp token cache {CACHE_FORMAT}".encode())
    return h.hexdigest()[:24]


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "autosp", "tokens")


def find(path: str, tokenizer: Tokenizer, text_field: str, cache_dir: str | None = None) -> TokenCache | None:
    """The cache of these inputs, if one was written."""
    folder = os.path.join(cache_dir or default_cache_dir(), cache_key(path, tokenizer, text_field))
    meta = os.path.join(folder, "meta.json")
    if not os.path.isfile(meta):
        return None
    with open(meta) as f:
        return TokenCache(folder, json.load(f))


_WORKER = {}


def _init_worker(tokenizer: Tokenizer) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")      # the processes are the parallelism
    tok = tokenizer.load()
    if hasattr(tok, "model_max_length"):         # a document is not a model input: no warning for its length
        tok.model_max_length = 1 << 62
    _WORKER["tok"] = tok


def _encode(texts: list[str]) -> list[list[int]]:
    tok = _WORKER["tok"]
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    return ids


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    batch, size = [], 0
    for d in docs:
        batch.append(d)
        size += len(d)
        if size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


@contextlib.contextmanager
def staged(root: str, key: str):
    """A fresh temporary folder beside `root/key` for a cache being written; on any error (a bad row named by its
    caller) it is removed, so nothing half-written is ever found. `publish` renames it into place."""
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f"{key}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish(tmp: str, root: str, key: str, meta: dict) -> str:
    """`staged`'s folder with its meta.json, renamed to root/key (its path); another process of the node that
    finished first made the same cache, and this one is dropped."""
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    folder = os.path.join(root, key)
    try:
        os.rename(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def tokenize(path: str, tokenizer: Tokenizer, *, text_field: str = "text", cache_dir: str | None = None,
             workers: int | None = None, progress: bool = True) -> tuple[TokenCache, bool]:
    """(the cache of `--data PATH` tokenized by `tokenizer`, whether it was there already). Tokenizes with
    `workers` processes (default: the cores, at most 8), writing into a temporary folder renamed into place."""
    found = find(path, tokenizer, text_field, cache_dir)
    if found is not None:
        return found, True
    root = cache_dir or default_cache_dir()
    key = cache_key(path, tokenizer, text_field)
    vocab, eos = tokenizer.vocab_and_eos()
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    bar = _bar() if progress else None
    starts, count, docs_seen = [], 0, 0
    try:
        with staged(root, key) as tmp:
            workers = workers or min(8, os.cpu_count() or 1)
            with open(os.path.join(tmp, "tokens.bin"), "wb") as out:
                for texts, ids in _tokenized(_batches(documents(path, text_field)), tokenizer, workers):
                    for text, doc in zip(texts, ids):
                        starts.append(count)
                        arr = np.asarray(doc + [eos], dtype=np.int64)
                        if arr.size and int(arr.max()) >= vocab:
                            raise AutospError(f"--tokenizer {tokenizer.path}: produced id {int(arr.max())}, beyond its "
                                              f"{vocab} ids. Fix: a tokenizer whose len() covers every id it makes.")
                        out.write(arr.astype(dtype).tobytes())
                        count += arr.size
                        docs_seen += 1
                    if bar is not None:
                        bar.update(len(texts))
                        bar.set_postfix_str(f"{count:,} tokens", refresh=False)
            if docs_seen == 0 or count == docs_seen:
                raise AutospError(f"--data {path}: {'no documents' if docs_seen == 0 else 'every document is empty'}. "
                                  "Fix: a corpus with text in it (check --text-field).")
            np.save(os.path.join(tmp, "starts.npy"), np.asarray(starts, dtype=np.int64))
            meta = {"tokens": count, "documents": docs_seen, "dtype": np.dtype(dtype).name, "eos": eos, "vocab": vocab,
                    "tokenizer": tokenizer.path, "text_field": text_field, "sources": sources(path),
                    "format": CACHE_FORMAT, "libraries": None if tokenizer.path == "bytes" else library_versions()}
            return TokenCache(publish(tmp, root, key, meta), meta), False
    finally:
        if bar is not None:
            bar.close()


def _tokenized(batches, tokenizer: Tokenizer, workers: int):
    """(texts, their ids) per batch, in order: in `workers` processes, or here for one."""
    if workers <= 1:
        _init_worker(tokenizer)
        for texts in batches:
            yield texts, _encode(texts)
        return
    import multiprocessing as mp
    ctx = mp.get_context("fork" if hasattr(os, "fork") else "spawn")
    pending: list = []
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        for texts in batches:                  # a few batches in flight per worker, read while they encode
            pending.append((texts, pool.apply_async(_encode, (texts,))))
            if len(pending) >= 2 * workers:
                texts0, job = pending.pop(0)
                yield texts0, job.get()
        for texts0, job in pending:
            yield texts0, job.get()


def _bar():
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(unit="doc", desc="tokenizing", dynamic_ncols=True)
